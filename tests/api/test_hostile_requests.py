"""Hostile requests (issue 25, "One request can freeze the API" and "Streams"), each against
the real app under uvicorn where timing matters: a spec of 50,000 unknown fields is a quick
422 with a bounded list of problems while /healthz keeps answering; JSON nested 100,000 deep
is a 422 naming the limit on every JSON route, never a 500; one user's event streams are
capped (429 with Retry-After), and an open stream ends within seconds of its token being
revoked or its dashboard session logged out."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from support.db import SPEC, Factory
from support.liveserver import live_server

from torchyard.api.app import create_app
from torchyard.api.deps import CSRF_HEADER, TokenCache
from torchyard.api.jsonlimits import depth_of, depth_problem
from torchyard.contracts.specerrors import MAX_LISTED
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import ApiToken
from torchyard.store.uisessions import token_id_for

pytestmark = pytest.mark.hostile

HEALTHZ_MAX_S = 0.5
DEEP = 100_000


@contextlib.contextmanager
def _server(app: FastAPI) -> Iterator[str]:
    """The real app under uvicorn on a free port, in this process: its base URL."""
    with live_server(app) as port:
        yield f"http://127.0.0.1:{port}"


def _healthz_during(base: str, hostile: Any) -> tuple[Any, float]:
    """Run `hostile()` in a thread while /healthz is asked over and over: its result and
    the slowest /healthz seen meanwhile."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["result"] = hostile()

    t = threading.Thread(target=run)
    slowest = 0.0
    with httpx.Client(base_url=base, timeout=30) as c:
        c.get("/healthz")  # the connection is open before the clock starts
        t.start()
        while t.is_alive():
            start = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            slowest = max(slowest, time.perf_counter() - start)
            time.sleep(0.01)
    t.join()
    return out["result"], slowest


def _unknown_fields(n: int) -> dict[str, Any]:
    return SPEC | {f"f{i}": 1 for i in range(n)}


@pytest.mark.parametrize("route", ["jobs", "sweeps"])
def test_a_spec_of_50000_unknown_fields_is_a_quick_bounded_422(
    app: FastAPI, alice: dict[str, str], route: str
) -> None:
    spec = _unknown_fields(50_000)
    body = spec if route == "jobs" else {
        "spec": spec,
        "space": {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-1}},
        "objective": {"metric": "val/loss", "mode": "min"},
        "trials": 2,
    }  # fmt: skip
    raw = json.dumps(body).encode()
    assert 500_000 < len(raw) < 1_048_576  # the review's 0.5 MB, under the body limit
    with _server(app) as base:

        def post() -> tuple[httpx.Response, float]:
            start = time.perf_counter()
            with httpx.Client(base_url=base, timeout=60) as c:
                r = c.post(f"/v1/{route}", content=raw, headers=alice)
            return r, time.perf_counter() - start

        (r, took), slowest = _healthz_during(base, post)
    assert r.status_code == 422, r.text[:500]
    details = r.json()["error"]["details"]
    assert len(details) <= MAX_LISTED + 1  # was one per field: 50,000
    assert "more" in details[-1]["message"] and "49" in details[-1]["message"]
    assert len(r.content) < 20_000
    assert slowest < HEALTHZ_MAX_S, f"/healthz took {slowest:.3f}s during the submit"
    assert took < 5, f"the 422 took {took:.1f}s"


def test_unknown_fields_still_get_their_did_you_mean(
    client: TestClient, alice: dict[str, str]
) -> None:
    r = client.post("/v1/jobs", json=SPEC | {"lr": 0.1, "epoch": 3}, headers=alice)
    problems = {d["field"]: d["message"] for d in r.json()["error"]["details"]}
    assert problems == {
        "lr": "unknown field (did you mean 'optimizer.lr'?)",
        "epoch": "unknown field (did you mean 'epochs'?)",
    }


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/sweeps"])
def test_json_nested_100000_deep_is_a_422_naming_the_limit(
    client: TestClient, alice: dict[str, str], path: str
) -> None:
    for body, content_type in (
        (_deep(DEEP), "application/json"),
        (b'{"spec": ' * DEEP + b"1" + b"}" * DEEP, "application/json"),
        (_deep(DEEP), "text/plain"),  # the routes read any body as JSON
        (_deep(DEEP), ""),
    ):
        headers = alice | ({"Content-Type": content_type} if content_type else {})
        r = client.post(path, content=body, headers=headers)
        assert r.status_code == 422, r.text[:300]
        err = r.json()["error"]
        assert err["details"][0]["field"] == "body"
        assert "TORCHYARD_MAX_JSON_DEPTH" in err["details"][0]["message"]


def test_every_json_route_refuses_a_deep_body(
    client: TestClient, alice: dict[str, str], admin: dict[str, str]
) -> None:
    """Routes whose body FastAPI parses (a quota, a dashboard login) too."""
    for method, path, headers in (
        ("PUT", "/v1/users/alice/quota", admin),
        ("POST", "/v1/ui/sessions", alice),
    ):
        r = client.request(method, path, content=_deep(DEEP), headers=headers)
        assert r.status_code == 422, r.text[:300]
        assert "nested" in r.json()["error"]["message"]


def test_a_spec_within_the_depth_limit_is_accepted(
    client: TestClient, alice: dict[str, str], settings: Settings
) -> None:
    assert settings.max_json_depth == 64
    args: Any = 1
    for _ in range(60):
        args = {"a": args}
    spec = SPEC | {"model": {"name": "mynets:deep", "args": args}}
    r = client.post("/v1/jobs", json=spec, headers=alice)
    assert r.status_code == 403, r.text  # parsed and checked: only the permission is missing


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert depth_of(b'{"a": [1, {"b": []}]}') == 4
    assert depth_of(json.dumps({"a": "[[[[{{{{", "b": '\\"[[['}).encode()) == 1
    assert depth_of(b"[]" * 1000) == 1
    assert depth_problem(json.dumps({"s": "[" * 10_000}).encode(), 64) is None
    assert depth_problem(_deep(65), 64) is not None
    assert depth_problem(_deep(64), 64) is None


# -- streams ---------------------------------------------------------------------------------


@pytest.fixture
def stream_app(settings: Settings) -> FastAPI:
    """The app with 3 streams a user, credentials re-checked every 0.1 s and tokens cached
    for 0.5 s (the defaults: 20, 2 s and 5 s; the bound is their sum)."""
    app = create_app(settings.model_copy(update={"max_streams_per_user": 3}))
    app.state.feed_poll_s = 0.05
    app.state.stream_recheck_s = 0.1
    app.state.token_cache = TokenCache(ttl_s=0.5)
    return app


@contextlib.contextmanager
def _stream(c: httpx.Client, path: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
    with c.stream("GET", path, headers=headers) as r:
        yield r


def _ends_within(r: httpx.Response, seconds: float) -> float:
    """Read the stream until the server ends it: how long that took (fails past
    `seconds`: the read timeout)."""
    start = time.monotonic()
    with contextlib.suppress(httpx.RemoteProtocolError):
        for _ in r.iter_bytes():
            assert time.monotonic() - start < seconds, "the stream is still open"
    took = time.monotonic() - start
    assert took < seconds
    return took


def test_streams_are_capped_per_user(
    stream_app: FastAPI, factory: Factory, alice: dict[str, str], bob: dict[str, str]
) -> None:
    job, theirs = factory.job("alice"), factory.job("bob")
    with _server(stream_app) as base, httpx.Client(base_url=base, timeout=10) as c:
        with contextlib.ExitStack() as open_streams:
            held = [
                open_streams.enter_context(_stream(c, f"/v1/jobs/{job}/events", alice))
                for _ in range(3)
            ]
            assert [r.status_code for r in held] == [200] * 3
            over = c.get(f"/v1/jobs/{job}/events", headers=alice)
            assert over.status_code == 429, over.text
            assert over.headers["Retry-After"] == "5"
            assert over.json()["error"]["code"] == "too_many_streams"
            assert "TORCHYARD_MAX_STREAMS_PER_USER" in over.json()["error"]["message"]
            assert c.get("/v1/ui/jobs/changes", headers=alice).status_code == 429  # every kind
            with _stream(c, f"/v1/jobs/{theirs}/events", bob) as other:
                assert other.status_code == 200  # other users are not affected
            assert c.get(f"/v1/jobs/{job}", headers=alice).status_code == 200
        # The streams closed: their slots come back once the server sees them go.
        deadline = time.monotonic() + 10
        while True:
            with _stream(c, f"/v1/jobs/{job}/events", alice) as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the slots never came back"
            time.sleep(0.1)


def test_a_revoked_token_ends_its_open_streams(
    stream_app: FastAPI, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job = factory.job("alice")
    token = alice["Authorization"].removeprefix("Bearer ")
    with _server(stream_app) as base, httpx.Client(base_url=base, timeout=10) as c:
        with (
            _stream(c, f"/v1/jobs/{job}/events", alice) as events,
            _stream(c, "/v1/ui/jobs/changes", alice) as changes,
        ):
            assert events.status_code == changes.status_code == 200
            with session_scope(db_url) as s:
                tid = token_id_for(s, token)
                s.get(ApiToken, tid).revoked_at = s.get(ApiToken, tid).created_at  # type: ignore[union-attr]
            assert _ends_within(events, 3) < 3
            assert _ends_within(changes, 3) < 3
        assert c.get(f"/v1/jobs/{job}/events", headers=alice).status_code == 401


def test_logging_out_ends_the_dashboards_open_streams(
    stream_app: FastAPI, factory: Factory, alice: dict[str, str]
) -> None:
    job = factory.job("alice")
    with _server(stream_app) as base, httpx.Client(base_url=base, timeout=10) as c:
        login = c.post("/v1/ui/sessions", json={}, headers=alice)
        assert login.status_code == 201, login.text
        csrf = login.json()["csrf"]
        with (
            _stream(c, f"/v1/jobs/{job}/events", {}) as events,
            _stream(c, "/v1/ui/jobs/changes", {}) as changes,
        ):
            assert events.status_code == changes.status_code == 200  # the cookie's
            assert c.delete("/v1/ui/session", headers={CSRF_HEADER: csrf}).status_code == 204
            assert _ends_within(events, 2) < 2
            assert _ends_within(changes, 2) < 2
