"""The async job reads (store/asyncreads.py) that GET /v1/jobs/{id} uses on PostgreSQL:
the same dict as store/jobs.py's sync reads, visibility included, and through a database
restart better than the sync path: no 503 once the server is back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from support.db import Factory, empty_postgres
from support.services import PrivatePostgres

from torchyard.store.asyncreads import AsyncReads
from torchyard.store.db import session_scope
from torchyard.store.jobs import Viewer, job_snapshot, job_version
from torchyard.store.metrics import ingest_metrics
from torchyard.store.migrate import upgrade
from torchyard.store.states import RUNNING, SUCCEEDED


@pytest.fixture
def pg(pg_migrated: str) -> str:
    """The shared migrated PostgreSQL database, emptied first (as db_url's is)."""
    empty_postgres(pg_migrated)
    return pg_migrated


@pytest.mark.postgres
def test_async_reads_return_what_the_sync_reads_do(pg: str) -> None:
    pg_migrated, factory = pg, Factory(pg)
    running = factory.job("alice", state=RUNNING)
    factory.attempt(running, workers=2)
    with session_scope(pg_migrated) as s:
        ingest_metrics(s, running, [
            {"name": "train/loss", "step": k, "value": 1.0 / (k + 1), "time": float(k)}
            for k in range(5)
        ])  # fmt: skip
    done = factory.job("alice", state=SUCCEEDED)
    queued = factory.job("bob")
    alice = Viewer(factory.user_id("alice"), False)
    bob = Viewer(factory.user_id("bob"), False)
    admin = Viewer(factory.user_id("root"), True)
    cases = [(v, j) for v in (alice, bob, admin) for j in (running, done, queued)]
    cases += [(admin, "0" * 32), (admin, "f" * 65)]  # missing, and an id too long to exist

    async def both() -> list[tuple[object, object]]:
        reads = AsyncReads(pg_migrated, pool_timeout=5)
        await reads.open()
        try:
            return [
                (await reads.job_snapshot(v, j), await reads.job_version(v, j)) for v, j in cases
            ]
        finally:
            await reads.close()

    got = asyncio.run(both())
    with session_scope(pg_migrated) as s:
        want = [(job_snapshot(s, v, j), job_version(s, v, j)) for v, j in cases]
    assert got == want
    seen = [g for g, _ in got if g is not None]
    assert len(seen) == 6  # alice's two, bob's one, the admin's three; with the metrics:
    assert got[0][0]["latest_metrics"]["train/loss"]["step"] == 4  # type: ignore[index]
    assert [len(a["workers"]) for a in got[0][0]["attempts"]] == [2]  # type: ignore[index]


async def _poll(reads: AsyncReads, job: str) -> str:
    try:
        return f"version {await reads.job_version(Viewer(0, True), job)}"
    except Exception as e:
        return type(e).__name__


async def _fill(reads: AsyncReads, job: str, n: int) -> None:
    """Concurrent reads until the pool holds `n` connections."""
    for _ in range(50):
        await asyncio.gather(*(_poll(reads, job) for _ in range(2 * n)))
        if reads.pool.get_stats()["pool_size"] >= n:
            return
    raise AssertionError(f"the pool did not grow to {n}: {reads.pool.get_stats()}")


@pytest.fixture
def private_pg() -> Iterator[tuple[PrivatePostgres, str]]:
    """A PostgreSQL of the test's own (it is stopped and started) with one queued job."""
    pg = PrivatePostgres()
    try:
        pg.start()
        upgrade(pg.url())
        yield pg, Factory(pg.url()).job("alice")
    finally:
        pg.destroy()


@pytest.mark.postgres
def test_async_reads_fail_promptly_in_an_outage_and_return_with_the_server(
    private_pg: tuple[PrivatePostgres, str],
) -> None:
    """An outage longer than the pool's backoff (1, 2, 4 s… between its background
    reconnection attempts): reads fail at once while the server is down, and the first read
    after it is back waits at most about a pool timeout, not for the backoff. The pool is
    full when the outage starts, so it cannot grow past the reconnections it has pending."""
    pg, job = private_pg

    async def scenario() -> tuple[str, list[str], list[str], float]:
        reads = AsyncReads(pg.url(), pool_timeout=0.5, max_size=3)
        await reads.open()
        try:
            await _fill(reads, job, 3)
            before = await _poll(reads, job)
            await asyncio.to_thread(pg.stop)
            during = []
            t_down = time.monotonic()
            while time.monotonic() - t_down < 9:
                t = time.monotonic()
                during.append(await _poll(reads, job))
                assert time.monotonic() - t < 2.0  # a prompt error, never a hang
                await asyncio.sleep(0.5)
            await asyncio.to_thread(pg.start)
            t, after = time.monotonic(), []
            while (got := await _poll(reads, job)) != before and time.monotonic() - t < 10:
                after.append(got)
                await asyncio.sleep(0.1)
            return before, during, [*after, got], time.monotonic() - t
        finally:
            await reads.close()

    before, during, after, took = asyncio.run(scenario())
    assert before.startswith("version ")
    # Every read while the store is down fails as "unavailable" (the API's 503), never as a
    # pool that looks busy: psycopg's OperationalError.
    assert set(during) == {"OperationalError"} and len(during) >= 8, during
    assert after[-1] == before and took < 1.5, (after, took)


@pytest.mark.postgres
def test_no_read_fails_after_a_database_restart_it_did_not_see(
    private_pg: tuple[PrivatePostgres, str],
) -> None:
    """The server restarts while the pool holds idle connections: each of them is broken,
    yet no read after the restart fails (a broken connection sends the read to a fresh
    one, and the pool drops its other broken ones)."""
    pg, job = private_pg

    async def scenario() -> tuple[int, list[str]]:
        reads = AsyncReads(pg.url(), pool_timeout=2.0)
        await reads.open()
        try:
            await _fill(reads, job, 4)
            held = reads.pool.get_stats()["pool_size"]
            await asyncio.to_thread(pg.stop)
            await asyncio.to_thread(pg.start)
            polls = [await _poll(reads, job) for _ in range(3)]
            polls += await asyncio.gather(*(_poll(reads, job) for _ in range(8)))
            return held, polls
        finally:
            await reads.close()

    held, polls = asyncio.run(scenario())
    assert held >= 4
    assert all(p.startswith("version ") for p in polls), polls
