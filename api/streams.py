"""What every event stream (server-sent events: a job's events, the jobs table's changes)
is held to: a per-user cap on the streams open at once in this process
(TORCHYARD_MAX_STREAMS_PER_USER; the next is 429 with Retry-After before it starts), and
the credential it was opened with checked again every RECHECK_S while it is open, so a
revoked token or a logged-out dashboard session ends its streams within seconds.

`guarded_stream(request, user, source)` takes the slot (or raises the 429) and wraps the
stream's frames; the slot is given back however the stream ends, also when it never
started (the client left before the first byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request

from torchyard.api.deps import Principal, still_authorized
from torchyard.api.errors import ApiError

RECHECK_S = 2.0  # how often an open stream checks its credential (app.state.stream_recheck_s)
RETRY_AFTER_S = 5


class StreamSlots:
    """Streams open per user in this process."""

    def __init__(self) -> None:
        self.open: dict[int, int] = {}

    def take(self, user_id: int, limit: int) -> Callable[[], None]:
        """A slot for one more stream of `user_id` (429 past `limit`): the function that
        gives it back (once, however often it is called)."""
        held = self.open.get(user_id, 0)
        if held >= limit:
            raise ApiError(
                429,
                f"you have {held} event streams open, the most allowed "
                "(TORCHYARD_MAX_STREAMS_PER_USER); close one or retry later",
                code="too_many_streams",
                details={"limit": limit},
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.open[user_id] = held + 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            left = self.open.get(user_id, 0) - 1
            if left > 0:
                self.open[user_id] = left
            else:
                self.open.pop(user_id, None)

        return give_back


def _slots(app: FastAPI) -> StreamSlots:
    slots = getattr(app.state, "stream_slots", None)
    if slots is None:
        slots = app.state.stream_slots = StreamSlots()
    return slots


Visible = Callable[[], Awaitable[bool]]


def guarded_stream(
    request: Request,
    user: Principal,
    source: AsyncIterator[bytes],
    still_visible: Visible | None = None,
) -> AsyncIterator[bytes]:
    """`source`'s frames, within the user's stream cap (429 raised here, before the
    response starts) and for as long as the request's credential stands and, with
    `still_visible`, what it streams is still the user's to see (a role taken away in its
    project ends the stream at the next check)."""
    state = request.app.state
    give_back = _slots(request.app).take(user.id, state.settings.max_streams_per_user)
    every_s = float(getattr(state, "stream_recheck_s", RECHECK_S))
    stream = _guarded(request, user, source, give_back, every_s, still_visible)
    weakref.finalize(stream, give_back)  # never iterated: nothing else would run
    return stream


async def _next(it: AsyncIterator[bytes]) -> bytes:
    return await it.__anext__()


async def _guarded(
    request: Request,
    user: Principal,
    source: AsyncIterator[bytes],
    give_back: Callable[[], None],
    every_s: float,
    still_visible: Visible | None = None,
) -> AsyncIterator[bytes]:
    """The frames of `source`, read in a task of their own so that an idle stream (no
    event for minutes) still checks its credential every `every_s`; ends when the
    credential no longer stands."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Task[bytes] | None = None
    due = loop.time() + every_s
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(_next(source))
            done, _ = await asyncio.wait({pending}, timeout=max(0.0, due - loop.time()))
            if done:
                task, pending = pending, None
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    return
                yield chunk
            if loop.time() >= due:
                if not await still_authorized(request, user):
                    return  # revoked or logged out: a reconnect gets 401
                if still_visible is not None and not await _visible(still_visible):
                    return  # no longer in the project: a reconnect gets 404
                due = loop.time() + every_s
    finally:
        give_back()
        await _close(pending, source)


async def _visible(check: Visible) -> bool:
    """A store that cannot answer ends nothing (as for the credential)."""
    try:
        return await check()
    except Exception:
        return True


async def _close(pending: asyncio.Task[Any] | None, source: AsyncIterator[bytes]) -> None:
    """Stop the read in flight (its generator ends with it), then close the source."""
    if pending is not None:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
