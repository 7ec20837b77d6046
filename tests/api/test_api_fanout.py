"""The SSE fan-out (api.fanout): many followers of one job over real HTTP share one store
poll per tick and all see every event; followers that fall out of the ring or connect late
catch up from the store; leaving stops the poller; a failing store breaks the streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy.orm import sessionmaker
from support.db import Factory
from support.follow import measure  # bench/follow_bench.py's too: both measure one thing

from torchyard.api.deps import TOKEN_CACHE_TTL_S
from torchyard.api.fanout import FeedFailed, FeedHub, read_page
from torchyard.api.streams import RECHECK_S
from torchyard.store.db import make_engine, session_scope
from torchyard.store.feed import FeedCursor
from torchyard.store.metrics import ingest_metrics

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

# SQL statements of one feed poll: the job's state, metrics, checkpoints and job events
# (+ the BEGIN of SQLite's deferred read transaction).
POLL_STATEMENTS = 5
# SQL statements of an open stream's re-check (its job still visible, or its token's user
# once the token cache's entry expired): a SELECT (+ BEGIN on SQLite).
RECHECK_STATEMENTS = 2
# SQL statements of one follower's connect: its token, then the job's visibility (each a
# SELECT, + BEGIN on SQLite).
CONNECT_STATEMENTS = 4


def test_followers_share_one_store_poll_per_tick(app: FastAPI, db_url: str) -> None:
    followers, rate, seconds = 20, 40.0, 1.0
    app.state.feed_poll_s = 0.05
    r = asyncio.run(measure(app, db_url, followers, rate, seconds))
    assert r.fed == 40
    # every follower saw every event: its status (no log, no pending reason: one), 4
    # states (queued, starting, running, succeeded), each point, then `end`, with the
    # same ids in the same order
    assert r.received == [{"status": 1, "state": 4, "metric": 40, "end": 1}] * followers
    assert r.sequences == 1
    # while streaming: one store poll per poller tick in all, not one per follower (a
    # poll in flight when counting started can add one)
    assert r.ticks >= 5
    assert r.polls <= r.ticks + 1
    assert r.statements - r.rechecks <= (r.ticks + 1) * POLL_STATEMENTS
    # each open stream re-checks the job is still its user's every RECHECK_S: one SELECT
    # (+ BEGIN on SQLite) per stream per period of its life (a slow run's streams live past
    # the first period: CI saw 18 re-checks in a 2 s stream), and their one token's user
    # once per TOKEN_CACHE_TTL_S
    lifetime = r.extra["connect_s"] + r.seconds
    periods = int(lifetime / RECHECK_S) + 1
    token_reads = int(lifetime / TOKEN_CACHE_TTL_S) + 1
    assert r.rechecks <= (followers * periods + token_reads) * RECHECK_STATEMENTS
    # connecting costs each follower its auth and visibility check, and nothing else
    ticks_during_connect = r.extra["connect_polls"] + 1
    bound = followers * CONNECT_STATEMENTS + ticks_during_connect * POLL_STATEMENTS
    assert r.connect_statements <= bound


def _points(job: str, db_url: str, steps: range) -> None:
    with session_scope(db_url) as s:
        rows = [{"name": "loss", "step": k, "epoch": 0.0, "value": 1.0, "time": 1.0} for k in steps]
        ingest_metrics(s, job, rows)


def _parse(chunks: list[bytes]) -> list[tuple[str, str, str]]:
    """(event, id, data) of each event."""
    return [
        (e, i, d)
        for e, i, d in (
            (lambda f: (f.get("event", ""), f.get("id", ""), f.get("data", "")))(
                dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln)
            )
            for block in b"".join(chunks).decode().split("\n\n")
        )
        if e
    ]


async def _drain(stream: AsyncIterator[bytes], into: list[bytes]) -> None:
    async for chunk in stream:
        into.append(chunk)


async def _until(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


def test_slow_and_late_followers_catch_up_from_the_store(db_url: str, factory: Factory) -> None:
    job = factory.job("alice", state="running")
    reads = make_engine(db_url, read_only=True)

    async def run() -> tuple[FeedHub, list[list[bytes]]]:
        hub = FeedHub(lambda: sessionmaker(reads), ring_items=4)
        slow = hub.follow(job, FeedCursor(), poll_s=0.01)
        got_slow = [await slow.__anext__()]  # attached, then not read for a while
        _points(job, db_url, range(10))
        await _until(lambda: hub.feeds[job].first_seq > 0 and hub.feeds[job].head.metric > 0)
        assert hub.feeds[job].first_seq > 0  # the ring dropped items the slow one lacks
        got_late: list[bytes] = []
        late = asyncio.create_task(_drain(hub.follow(job, FeedCursor(), 0.01), got_late))
        await _until(lambda: hub.catch_ups > 0)
        _points(job, db_url, range(10, 15))
        factory.set_state(job, "succeeded")
        await asyncio.wait_for(_drain(slow, got_slow), 10)
        await asyncio.wait_for(late, 10)
        return hub, [got_slow, got_late]

    hub, streams = asyncio.run(run())
    reads.dispose()
    slow_events, late_events = (_parse(s) for s in streams)
    # the same events from each source in the same order (how the sources interleave
    # depends on when each store page was read, as it always has)
    for kind in ("state", "metric", "end"):
        assert [d for e, _, d in slow_events if e == kind] == [
            d for e, _, d in late_events if e == kind
        ]
    kinds = [e for e, _, _ in slow_events]
    assert kinds.count("metric") == 15 and kinds[-2:] == ["state", "end"]
    steps = [int(d.split('"step":')[1].split(",")[0]) for e, _, d in slow_events if e == "metric"]
    assert steps == list(range(15))
    assert len({i for _, i, _ in slow_events}) == len(slow_events) - 1  # `end` repeats the last id
    assert hub.catch_ups >= 2 and hub.feeds == {}  # both caught up; the poller is gone


def test_leaving_followers_stop_the_poller(db_url: str, factory: Factory) -> None:
    job = factory.job("alice", state="running")
    reads = make_engine(db_url, read_only=True)

    async def run() -> None:
        hub = FeedHub(lambda: sessionmaker(reads))
        a, b = hub.follow(job, FeedCursor(), 0.01), hub.follow(job, FeedCursor(), 0.01)
        await a.__anext__()
        await b.__anext__()
        feed = hub.feeds[job]
        assert feed.followers == 2 and feed.task is not None
        reader = asyncio.create_task(_drain(b, []))  # waiting for events when it is dropped
        await _until(lambda: hub.polls >= 2)
        await a.aclose()
        assert hub.feeds[job] is feed and not feed.task.done()  # b still follows
        reader.cancel()  # b's client disconnects
        await asyncio.gather(reader, return_exceptions=True)
        await asyncio.sleep(0)
        assert hub.feeds == {} and feed.task.done()

    asyncio.run(run())
    reads.dispose()


def test_a_failing_store_breaks_the_streams(tmp_path: Path, db_url: str) -> None:
    broken = make_engine(f"sqlite:///{tmp_path}/missing/dir/x.db", read_only=True)

    async def run() -> FeedHub:
        hub = FeedHub(lambda: sessionmaker(broken))
        stream = hub.follow("f" * 32, FeedCursor(), 0.01)
        await stream.__anext__()
        with pytest.raises(FeedFailed, match="reading the job's events failed"):
            await asyncio.wait_for(_drain(stream, []), 30)
        return hub

    hub = asyncio.run(run())
    broken.dispose()
    assert hub.feeds == {} and hub.polls == 4  # retried, then given up


def test_a_resume_ahead_in_one_source_gets_what_a_direct_read_gives(
    db_url: str, factory: Factory
) -> None:
    job = factory.job("alice", state="running")
    _points(job, db_url, range(3))
    factory.set_state(job, "succeeded")
    reads = make_engine(db_url, read_only=True)
    resume = FeedCursor(event=2, metric=1)  # seen: queued, starting and the first point

    async def run() -> list[bytes]:
        hub = FeedHub(lambda: sessionmaker(reads))
        first = hub.follow(job, FeedCursor(), 0.01)  # starts the poller from the beginning
        await first.__anext__()
        got: list[bytes] = []
        await asyncio.wait_for(
            asyncio.gather(_drain(first, []), _drain(hub.follow(job, resume, 0.01), got)), 10
        )
        assert hub.catch_ups == 0  # served from the shared ring
        return got

    got = asyncio.run(run())
    page = read_page(sessionmaker(reads), job, resume)  # what the stream sent before the hub
    reads.dispose()
    want = [
        (i.type, i.cursor.encode(), json.dumps(i.data, separators=(",", ":"))) for i in page.items
    ]
    want.append(("end", page.cursor.encode(), '{"state": "succeeded"}'))
    assert _parse(got) == want
    assert [e for e, _, _ in want] == ["metric", "metric", "state", "state", "end"]
