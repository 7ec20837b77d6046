"""Pure ASGI middleware (cheap on the hot path): a request-body size limit answered with
413, a load shedder that answers 503 with Retry-After when the store-call threads are
swamped, and Prometheus request counters and latency histograms per route template."""

from __future__ import annotations

import json
import time
from collections.abc import Collection

import anyio.to_thread
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    pass


def _too_large_body(limit: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "code": "payload_too_large",
                "message": f"request body over {limit} bytes (TORCHYARD_MAX_BODY_BYTES)",
                "details": {"limit_bytes": limit},
            }
        }
    ).encode()


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ShedLoad:
    """Every store call runs on a small thread pool; when more requests already wait for a
    thread than it can serve in about a second, a new one gets 503 with Retry-After at once
    instead of queueing without bound (a fast no, never a hang). /healthz is never shed."""

    BODY = json.dumps(
        {
            "error": {
                "code": "busy",
                "message": "the server is busy; retry shortly",
                "details": None,
            }
        }
    ).encode()

    def __init__(self, app: ASGIApp, max_waiting: int):
        self.app, self.max_waiting = app, max_waiting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("path") != "/healthz"
            and anyio.to_thread.current_default_thread_limiter().statistics().tasks_waiting
            >= self.max_waiting
        ):
            await _send_json(send, 503, self.BODY, [(b"retry-after", b"1")])
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a declared Content-Length over the limit before reading anything, and for
    a streamed (chunked) body as soon as it passes the limit.

    `own_limit`: paths whose route streams its body to disk and enforces a limit of its own
    the same two ways (POST /v1/bundles: TORCHYARD_MAX_BUNDLE_BYTES, far above the JSON
    limit); they pass through here, so that their 413 names the setting that applies and
    the route can remove what it wrote."""

    def __init__(self, app: ASGIApp, max_bytes: int, own_limit: Collection[str] = ()):
        self.app, self.max_bytes, self.own_limit = app, max_bytes, frozenset(own_limit)

    async def _reject(self, send: Send) -> None:
        body = _too_large_body(self.max_bytes)
        await _send_json(send, 413, body, [(b"connection", b"close")])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.own_limit:
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._reject(send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send)


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length, 0 when absent or not a number (the body is counted
    as it arrives either way)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class PrometheusMetrics:
    """Counts requests and times them by method, route template and status."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(
            "torchyard_http_requests",
            "HTTP requests served",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "torchyard_http_request_duration_seconds",
            "time to the start of the response",
            ["method", "route"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = _route(scope)
                self.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.requests.labels(scope["method"], _route(scope), str(status)).inc()


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    # Templates only ("/v1/jobs/{job_id}"): raw paths would make unbounded label sets.
    return path if isinstance(path, str) else "unmatched"
