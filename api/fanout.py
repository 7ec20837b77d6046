"""The per-process fan-out of job feeds: however many SSE followers watch a job, one poller
task reads the store for it (one `store.feed.poll` per tick) and keeps the recent items in
a bounded ring that every follower reads at its own pace.

Followers pull: each keeps its own position in the ring, so a slow one never blocks the
poller or the others, and costs no memory beyond its position. One that falls out of the
ring (or connects with a Last-Event-ID older than it) reads the store itself until it is
back inside the ring. The poller starts with the first follower of a job and stops when
the last one leaves. Each uvicorn worker process has its own hub.

Besides the items, each tick reads what has no row id to resume from: a queued job's
pending reason (with its state, in the same statement) and the size of its log file (one
`stat` of the storage: `stored_log_size`). When either changes, every follower gets one `status` event without an `id:` (a
reconnect resumes after the last real item and gets the current status again), so a page
can follow the log and the pending reason without polling.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from torchyard.api.views import owner_reason
from torchyard.storage import Storage, UnsafePath, job_key
from torchyard.store.feed import FeedCursor, FeedItem, FeedPage, poll
from torchyard.store.paths import LOG_FILE

log = logging.getLogger(__name__)

RING_ITEMS = 10_000
# A store error is retried a few times (a restarting database) before the feed fails;
# its followers' streams then break, and their reconnects start a fresh poller.
POLL_ATTEMPTS = 4
SEP = "\n"  # the wire format the clients already parse


class FeedFailed(RuntimeError):
    """The job's poller gave up: the store kept failing."""


def frame(item: FeedItem, cursor: FeedCursor) -> bytes:
    """One SSE event, with `cursor` as its id."""
    data = json.dumps(item.data, separators=(",", ":"))
    return ServerSentEvent(data, event=item.type, id=cursor.encode(), sep=SEP).encode()


def end_frame(state: str | None, cursor: FeedCursor) -> bytes:
    return ServerSentEvent(
        json.dumps({"state": state}), event="end", id=cursor.encode(), sep=SEP
    ).encode()


def _covers(a: FeedCursor, b: FeedCursor) -> bool:
    """Everything up to `b` is at or before `a`, in each source."""
    return a.event >= b.event and a.metric >= b.metric and a.checkpoint >= b.checkpoint


def _merge(a: FeedCursor, b: FeedCursor) -> FeedCursor:
    return FeedCursor(
        max(a.event, b.event), max(a.metric, b.metric), max(a.checkpoint, b.checkpoint)
    )


def _seen(cursor: FeedCursor, item: FeedItem) -> bool:
    """Whether a follower at `cursor` already has `item` (each source's ids only grow)."""
    c = item.cursor
    if item.type == "metric":
        return c.metric <= cursor.metric
    if item.type == "checkpoint":
        return c.checkpoint <= cursor.checkpoint
    return c.event <= cursor.event


def read_page(factory: sessionmaker[Session], job_id: str, cursor: FeedCursor) -> FeedPage:
    with factory() as session:
        return poll(session, job_id, cursor)


def stored_log_size(storage: Storage, job_id: str) -> int:
    """The size of the job's log in `storage` (one `stat`); 0 when it is not written yet
    (a queued job), is refused, or the storage is briefly unreachable."""
    try:
        return storage.stat(job_key(job_id, LOG_FILE)).size
    except (OSError, UnsafePath):
        return 0


def read_tick(
    factory: sessionmaker[Session],
    job_id: str,
    cursor: FeedCursor,
    log_size: Callable[[str], int] | None,
) -> tuple[FeedPage, int]:
    """The poller's read: the next page, then the log's size (after the page, so a log
    line written before a metric the page holds is counted; 0 without `log_size`)."""
    page = read_page(factory, job_id, cursor)
    return page, log_size(job_id) if log_size is not None else 0


def status_frame(pending_reason: str | None, log_size: int) -> bytes:
    data = json.dumps({"pending_reason": pending_reason, "log_size": log_size})
    return ServerSentEvent(data, event="status", sep=SEP).encode()


@dataclass
class JobFeed:
    """One followed job: its poller's ring of (item, pre-encoded frame)."""

    job_id: str
    base: FeedCursor  # the poller's cursor before ring[0]
    head: FeedCursor  # the poller's cursor after the last item read
    poll_s: float
    ring: deque[tuple[FeedItem, bytes]]
    first_seq: int = 0  # sequence number of ring[0]
    followers: int = 0
    end_state: str | None = None
    ended: bool = False
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None
    status: tuple[str | None, int] | None = None  # (pending reason, log size) last read
    status_seq: int = 0  # bumped on each change; followers compare with theirs
    status_bytes: bytes = b""
    _tick: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.ring)

    def set_status(self, pending_reason: str | None, log_size: int) -> None:
        if self.status == (pending_reason, log_size):
            return
        self.status = (pending_reason, log_size)
        self.status_seq += 1
        self.status_bytes = status_frame(pending_reason, log_size)
        self.wake()

    def publish(self, page: FeedPage) -> None:
        for item in page.items:
            if len(self.ring) == self.ring.maxlen:
                self.base = self.ring[0][0].cursor
                self.first_seq += 1
            self.ring.append((item, frame(item, item.cursor)))
        self.head = page.cursor
        if page.finished:
            self.ended, self.end_state = True, page.state
        if page.items or page.finished:
            self.wake()

    def wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def changed(self) -> None:
        await self._tick.wait()


class FeedHub:
    """The job feeds of this process, by job id."""

    def __init__(
        self,
        factory: Callable[[], sessionmaker[Session]],
        ring_items: int = RING_ITEMS,
        log_size: Callable[[str], int] | None = None,
    ):
        self._factory = factory  # read lazily: tests swap the app's sessions
        self.ring_items = ring_items
        self._log_size = log_size  # a job's log size now (None: no status events)
        self.feeds: dict[str, JobFeed] = {}
        self.polls = 0  # store polls by pollers (one per tick per followed job)
        self.catch_ups = 0  # store polls by followers outside the ring

    def _join(self, job_id: str, cursor: FeedCursor, poll_s: float) -> JobFeed:
        feed = self.feeds.get(job_id)
        if feed is None or feed.error is not None:
            ring: deque[tuple[FeedItem, bytes]] = deque(maxlen=self.ring_items)
            feed = JobFeed(job_id, base=cursor, head=cursor, poll_s=poll_s, ring=ring)
            feed.task = asyncio.create_task(self._run(feed), name=f"feed {job_id}")
            feed.task.add_done_callback(lambda t: self._died(feed, t))
            self.feeds[job_id] = feed
        feed.followers += 1
        return feed

    def _leave(self, feed: JobFeed) -> None:
        feed.followers -= 1
        if feed.followers <= 0:
            if self.feeds.get(feed.job_id) is feed:
                del self.feeds[feed.job_id]
            if feed.task is not None:
                feed.task.cancel()

    def _died(self, feed: JobFeed, task: asyncio.Task[None]) -> None:
        """Whatever ended the poller early, its followers must not wait forever."""
        if feed.ended or (task.cancelled() and feed.followers <= 0):
            return
        if feed.error is None:
            feed.error = FeedFailed("the job's event poller stopped")
        if self.feeds.get(feed.job_id) is feed:
            del self.feeds[feed.job_id]
        feed.wake()

    async def close(self) -> None:
        """Stop every poller (app shutdown); their followers' streams break."""
        tasks = [f.task for f in self.feeds.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.feeds.clear()

    async def _poll(self, feed: JobFeed) -> tuple[FeedPage, int]:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(POLL_ATTEMPTS),
            wait=wait_exponential(multiplier=0.25, max=4),
            reraise=True,
        ):
            with attempt:
                self.polls += 1
                return await run_in_threadpool(
                    read_tick, self._factory(), feed.job_id, feed.head, self._log_size
                )
        raise AssertionError("unreachable")  # reraise=True: the last error is raised

    async def _run(self, feed: JobFeed) -> None:
        try:
            while not feed.ended:
                page, log_size = await self._poll(feed)
                if self._log_size is not None:
                    # Other users' job ids and usage never reach a job's stream.
                    feed.set_status(owner_reason(page.pending_reason, feed.job_id), log_size)
                feed.publish(page)
                if not page.more and not feed.ended:
                    await asyncio.sleep(feed.poll_s)
        except Exception as e:  # ended here, not raised: _died wakes the followers
            log.warning("event feed of job %s failed: %s", feed.job_id, e)
            feed.error = FeedFailed(f"reading the job's events failed: {e}")

    async def follow(self, job_id: str, cursor: FeedCursor, poll_s: float) -> AsyncIterator[bytes]:
        """The job's events after `cursor`, as SSE frames, until its `end` event."""
        feed = self._join(job_id, cursor, poll_s)
        try:
            yield ServerSentEvent(retry=2000, sep=SEP).encode()
            async for chunk in self._follow(feed, cursor):
                yield chunk
        finally:
            self._leave(feed)

    async def _follow(self, feed: JobFeed, cursor: FeedCursor) -> AsyncIterator[bytes]:
        pos, status_seen = feed.first_seq, 0
        while True:
            if feed.error is not None:
                raise feed.error
            if feed.status_seq != status_seen:
                status_seen = feed.status_seq
                yield feed.status_bytes
            if not _covers(cursor, feed.base):  # behind the ring: read the store itself
                self.catch_ups += 1
                page = await run_in_threadpool(read_page, self._factory(), feed.job_id, cursor)
                chunk, cursor = _frames(page.items, cursor)
                if page.finished:
                    yield chunk + end_frame(page.state, _merge(cursor, page.cursor))
                    return
                cursor = _merge(cursor, page.cursor)
                pos = feed.first_seq
                if chunk:
                    yield chunk
                elif not page.more:  # the ring moved on meanwhile: do not spin on the store
                    await asyncio.sleep(feed.poll_s)
                continue
            pos = max(pos, feed.first_seq)
            if pos < feed.next_seq:
                items = list(itertools.islice(feed.ring, pos - feed.first_seq, None))
                pos = feed.next_seq
                chunk, cursor = _shared_frames(items, cursor)
                if chunk:
                    yield chunk
                continue
            if feed.ended:
                yield end_frame(feed.end_state, _merge(cursor, feed.head))
                return
            await feed.changed()


def _frames(items: list[FeedItem], cursor: FeedCursor) -> tuple[bytes, FeedCursor]:
    out = []
    for item in items:
        if not _seen(cursor, item):
            cursor = _merge(cursor, item.cursor)
            out.append(frame(item, cursor))
    return b"".join(out), cursor


def _shared_frames(
    items: list[tuple[FeedItem, bytes]], cursor: FeedCursor
) -> tuple[bytes, FeedCursor]:
    """Like `_frames`, re-using the poller's encoding where the follower's id is the
    poller's (always, unless the follower resumed from a cursor ahead in some source)."""
    out = []
    for item, encoded in items:
        if _seen(cursor, item):
            continue
        merged = _merge(cursor, item.cursor)
        out.append(encoded if merged == item.cursor else frame(item, merged))
        cursor = merged
    return b"".join(out), cursor
