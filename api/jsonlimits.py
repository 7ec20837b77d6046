"""How deep a JSON request body may nest, checked before any parser recurses into it.

Python's json module and pydantic recurse once per level: a 1 MB body of `[[[[…` is a
RecursionError (a 500) or a deep stack of work. `depth_problem` measures the nesting with
no recursion and no parse: the body's bytes outside strings, brackets counted. Cheap where
it matters: a body with no more opening brackets than the limit (every ordinary request)
is answered by two `bytes.count` calls; only a body with more is scanned, in C-level
passes (a regex that drops the strings, a byte translation, a running sum).

`JsonDepthLimit` applies it to every request that carries a JSON body (declared JSON or
undeclared, as FastAPI parses both), answering 422 before any route sees it.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Collection
from itertools import accumulate
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torchyard.api.errors import validation_error

# A JSON string: quote, anything but quote or backslash, escapes, quote (no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
# Opening brackets to +1, closing ones to -1 (255 read as a signed byte).
_STEPS = bytes.maketrans(_BRACKETS, bytes([1, 255, 1, 255]))
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def depth_of(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (brackets inside strings do not
    count); for a body that is not JSON, whatever its brackets add up to. UTF-8 (or
    ASCII) bodies: the only encodings the API's JSON routes are sent."""
    bare = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not bare:
        return 0
    return max(0, max(accumulate(array("b", bare.translate(_STEPS)))))


def depth_problem(body: bytes, limit: int) -> str | None:
    """Why `body` nests too deep for the API (the message of a 422), or None."""
    if body.count(b"[") + body.count(b"{") <= limit:  # cannot be deeper: no scan
        return None
    depth = depth_of(body)
    if depth <= limit:
        return None
    return (
        f"JSON nested {depth} levels deep; at most {limit} are accepted (TORCHYARD_MAX_JSON_DEPTH)"
    )


def too_deep_body(problem: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "code": "validation_error",
                "message": f"invalid request: body: {problem}",
                "details": [{"field": "body", "message": problem}],
            }
        }
    ).encode()


def _is_json(scope: Scope) -> bool:
    """A body FastAPI or a route would parse as JSON: declared `application/json` (or
    `+json`), or not declared at all."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";")[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


class JsonDepthLimit:
    """422 for a JSON request body nested deeper than `max_depth`, before any route or
    parser sees it. The body is read here (the BodyLimit middleware, outside this one,
    bounds it) and handed on whole; later `receive` calls (a disconnect) pass through.
    `skip`: paths whose body is not JSON whatever it declares (bundle uploads)."""

    def __init__(self, app: ASGIApp, max_depth: int, skip: Collection[str] = ()):
        self.app, self.max_depth, self.skip = app, max_depth, frozenset(skip)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") not in _BODY_METHODS
            or scope.get("path") in self.skip
            or not _is_json(scope)
        ):
            await self.app(scope, receive, send)
            return
        chunks, message = [], None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # a disconnect: the route sees it as it would have
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = depth_problem(body, self.max_depth)
        if problem is not None:
            await _reject(send, too_deep_body(problem))
            return
        await self.app(scope, _replay(body, message, receive), send)


def _replay(body: bytes, last: Message | None, receive: Receive) -> Receive:
    """A `receive` that gives the whole body once (or the disconnect read instead), then
    passes through."""
    first: list[Message] = [
        last
        if last is not None and last["type"] != "http.request"
        else {"type": "http.request", "body": body, "more_body": False}
    ]

    async def replayed() -> Message:
        if first:
            return first.pop()
        return await receive()

    return replayed


async def _reject(send: Send, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 422,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def decode_body(raw: bytes, max_depth: int, what: str) -> Any:
    """A route's JSON body decoded (None when empty), or 422 naming the problem: not JSON,
    or nested deeper than `max_depth` (checked here too: the middleware may be bypassed by
    a test's app, and the check is cheap). Blocking on a large body: call it off the event
    loop."""
    if not raw:
        return None
    problem = depth_problem(raw, max_depth)
    if problem is not None:
        raise validation_error([("body", problem)], what)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise validation_error([("body", f"not valid JSON: {e}")], what) from None
    except RecursionError:  # not UTF-8 (json also reads UTF-16 and UTF-32) and deep
        problem = f"JSON nested too deep; at most {max_depth} levels are accepted"
        raise validation_error([("body", problem)], what) from None
