"""The jobs table's live stream: one poller per API process (however many tables are
open) asks the store which jobs changed (store/uijobs.py: `changes_since`) and tells each
follower about the ones it may see; the page then reloads the rows it shows. The same tick
reads the workers' fingerprint (`workers_fingerprint`) and sends a `workers` event when a
worker registers, is lost or stops, or takes or ends a job: the workers page reloads on it.

A follower that falls behind loses nothing that matters: any `changes` event makes it
reload its whole page, so while one is queued, more are dropped. The poller starts with
the first follower and stops with the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from torchyard.store.jobs import Viewer
from torchyard.store.uijobs import (
    ChangeState,
    changes_since,
    changes_start,
    memberships,
    workers_fingerprint,
)

log = logging.getLogger(__name__)

QUEUE_ITEMS = 4
MAX_IDS = 100  # ids named in one event; the page reloads its rows whatever they are
RETRY_S = 2.0  # after a store error


@dataclass(eq=False)
class _Follower:
    viewer: Viewer
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_ITEMS)
    )

    def tell(self, changed: dict[str, int], projects: dict[int, set[int]]) -> None:
        """`changed`: job id -> project id; `projects`: user id -> their projects' ids."""
        seen = projects.get(self.viewer.user_id, set())
        mine = [j for j, p in changed.items() if self.viewer.is_admin or p in seen]
        if mine and not self.queue.full():
            self.queue.put_nowait(("changes", {"jobs": mine[:MAX_IDS]}))

    def tell_workers(self) -> None:
        if not self.queue.full():  # a queued event already makes the page reload
            self.queue.put_nowait(("workers", {}))


def _start(factory: sessionmaker[Session]) -> tuple[ChangeState, int]:
    with factory() as session:
        return changes_start(session), workers_fingerprint(session)


def _changes(
    factory: sessionmaker[Session], state: ChangeState, users: set[int]
) -> tuple[dict[str, int], int, dict[int, set[int]]]:
    with factory() as session:
        changed = changes_since(session, state, time.monotonic())
        return changed, workers_fingerprint(session), memberships(session, users)


class JobChanges:
    """The jobs-table feed of this process."""

    def __init__(self, factory: Callable[[], sessionmaker[Session]], poll_s: float):
        self._factory = factory  # read lazily: tests swap the app's sessions
        self.poll_s = poll_s
        self.followers: set[_Follower] = set()
        self.polls = 0
        self._task: asyncio.Task[None] | None = None

    async def follow(self, viewer: Viewer) -> AsyncIterator[bytes]:
        """`changes` events (`{"jobs": [ids]}`) for the jobs `viewer` may see, and `workers`
        events (`{}`) when the workers changed."""
        follower = _Follower(viewer)
        self.followers.add(follower)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="ui job changes")
        try:
            yield ServerSentEvent(retry=2000, sep="\n").encode()
            while True:
                event, body = await follower.queue.get()
                data = json.dumps(body, separators=(",", ":"))
                yield ServerSentEvent(data, event=event, sep="\n").encode()
        finally:
            self.followers.discard(follower)
            if not self.followers and self._task is not None:
                self._task.cancel()
                self._task = None

    async def _run(self) -> None:
        state: ChangeState | None = None
        workers = 0
        while self.followers:
            try:
                if state is None:
                    state, workers = await run_in_threadpool(_start, self._factory())
                else:
                    self.polls += 1
                    users = {f.viewer.user_id for f in self.followers if not f.viewer.is_admin}
                    changed, now, projects = await run_in_threadpool(
                        _changes, self._factory(), state, users
                    )
                    moved, workers = now != workers, now
                    for follower in list(self.followers):
                        follower.tell(changed, projects)
                        if moved:
                            follower.tell_workers()
            except Exception as e:  # the store is down: the streams stay open and wait
                log.warning("jobs table feed: store error: %s", e)
                await asyncio.sleep(RETRY_S)
                continue
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
