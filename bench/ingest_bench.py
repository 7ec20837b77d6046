"""Metric ingest speed through the worker's flush (worker/events.py: EventRecorder.write,
then commit, as the supervisor does), before issue 9 against now, on PostgreSQL and SQLite.

    .venv/bin/python bench/ingest_bench.py [--points 60000] [--batch 1000] [--reps 3]
                                           [--no-postgres] [--main]

"before" is the flush as it was before issue 9 (bench/ingest_before.py, frozen: six
statements per batch of new points) on the schema of then (migration 0009: foreign keys
from the metric tables to `jobs`, locale collation); "new, 0009 schema" the flush as it is
on that schema (the code's share of the gain); "new" the flush as it is on the current
schema. `--main` adds main's ingest of long ago (copied below and patched in: a
SQLAlchemy-built multi-row `INSERT … ON CONFLICT`, then two rollup statements per series;
slow). All write three series, in batches of `--batch` points, each batch fenced and
committed with its events offset, rollups and job version, into a new job; runs take
turns, `--reps` times each, and each one's run of fewest CPU seconds is shown. Wall clock
counts waiting for a shared machine's CPUs; CPU seconds (this process's, and the
PostgreSQL backends' of the bench database) do not. PostgreSQL runs in databases of its own on 127.0.0.1:5432
(`torchyard_bench_ingest*`, created and dropped here); SQLite in temporary files."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchlib import STORE_SPEC, scratch_postgres
from ingest_before import BeforeRecorder
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

import torchyard.worker.events as worker_events
from torchyard.store.auth import get_or_create_user
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import downgrade, upgrade
from torchyard.store.models import Attempt, Metric
from torchyard.worker.events import EventRecorder

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
PG_DB = "torchyard_bench_ingest"
SERIES = ("train/loss", "train/lr", "train/samples_per_s")


# main's rollup statements: one pair per series.
_OLD_FROM_POINTS = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT job_id, name, :level, step / :level, MIN(value), MAX(value), MAX(step), COUNT(*)
FROM metrics WHERE job_id = :job AND name = :name AND step >= :lo AND step < :hi
GROUP BY job_id, name, step / :level
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""
_OLD_FROM_BLOCKS = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT job_id, name, :level, block / :ratio, MIN(vmin), MAX(vmax), MAX(last_step), SUM(n)
FROM metric_blocks
WHERE job_id = :job AND name = :name AND level = :finer AND block >= :lo AND block < :hi
GROUP BY job_id, name, block / :ratio
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""


def _old_update_blocks(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    spans: dict[str, tuple[int, int]] = {}
    for r in rows:
        lo, hi = spans.get(r["name"], (r["step"], r["step"]))
        spans[r["name"]] = (min(lo, r["step"]), max(hi, r["step"]))
    for name, (lo, hi) in spans.items():
        if hi < 0:
            continue
        b_lo, b_hi = max(lo, 0) // 64, hi // 64 + 1
        session.execute(text(_OLD_FROM_POINTS), {"job": job_id, "name": name, "level": 64,
                                                 "lo": b_lo * 64, "hi": b_hi * 64})  # fmt: skip
        session.execute(text(_OLD_FROM_BLOCKS), {"job": job_id, "name": name, "level": 4096,
                        "ratio": 64, "finer": 64, "lo": (b_lo // 64) * 64,
                        "hi": (b_hi // 64 + 1) * 64})  # fmt: skip


def old_ingest_metrics(session: Session, job_id: str, rows: Iterable[dict[str, Any]]) -> int:
    """main's ingest_metrics: a SQLAlchemy multi-row upsert in chunks of 500, then rollups."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    values = [{"job_id": job_id, **r} for r in rows]
    dedup = list({(v["name"], v["step"]): v for v in values}.values())
    for i in range(0, len(dedup), 500):
        stmt = insert(Metric).values(dedup[i : i + 500])
        stmt = stmt.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={"epoch": stmt.excluded.epoch, "value": stmt.excluded.value,
                  "time": stmt.excluded.time},
        )  # fmt: skip
        session.execute(stmt)
    _old_update_blocks(session, job_id, dedup)
    return len(dedup)


def _job(url: str) -> tuple[str, int]:
    with session_scope(url) as s:
        user = get_or_create_user(s, "bench")
        job, _ = create_job(s, user.id, dict(STORE_SPEC), name="ingest-bench")
        attempt = Attempt(job_id=job.id, number=1, world_size=1)
        s.add(attempt)
        s.flush()
        return job.id, attempt.id


def _batches(points: int, batch: int) -> list[list[dict[str, Any]]]:
    """Metric events as the trainer writes them: every series at each step."""
    events = [
        {"type": "metric", "time": 1.7e9 + i, "step": i // 3, "epoch": 1,
         "name": SERIES[i % 3], "value": 1.0 / (1 + i)}
        for i in range(points)
    ]  # fmt: skip
    return [events[i : i + batch] for i in range(0, points, batch)]


def _server_cpu(url: str) -> Callable[[], float]:
    """CPU seconds used so far by the PostgreSQL backends of the bench database (read from
    /proc: the server is local); 0 for SQLite, which runs in this process."""
    if not url.startswith("postgresql"):
        return lambda: 0.0
    with session_scope(url) as s:
        sql = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        pids = list(s.scalars(text(sql)))
    tick = os.sysconf("SC_CLK_TCK")

    def used() -> float:
        total = 0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        return total / tick

    return used


Recorder = type[EventRecorder]


def _flush_all(
    url: str, batches: list[list[dict[str, Any]]], recorder: Recorder
) -> tuple[float, float, float]:
    """Seconds spent in the flushes (write + commit) of every batch, for a new job: wall
    clock, this process's CPU and the database server's."""
    job_id, attempt_id = _job(url)
    server = _server_cpu(url)
    wall = cpu = server_cpu = 0.0
    offset = 0
    for b in batches:
        rec = recorder(job_id, attempt_id, 1)
        for ev in b:
            rec.add(ev)
        offset += len(b) * 100
        rec.offset = offset
        t0, c0, s0 = time.perf_counter(), time.process_time(), server()
        with session_scope(url) as s:
            rec.write(s)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        server_cpu += server() - s0
    with session_scope(url) as s:
        n = s.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id))
    assert n == sum(map(len, batches)), n
    return wall, cpu, server_cpu


@contextmanager
def _patched(ingest: Callable[..., int]) -> Iterator[None]:
    saved = worker_events.ingest_metrics
    worker_events.ingest_metrics = ingest  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_events.ingest_metrics = saved  # type: ignore[assignment]


@contextmanager
def _as_is() -> Iterator[None]:
    yield


# (label, database: its schema, recorder, patch)
Variant = tuple[str, str, Recorder, Callable[[], Any]]


def _variants(old: str, new: str, main: bool) -> list[Variant]:
    out: list[Variant] = [
        ("before", old, BeforeRecorder, _as_is),
        ("new, 0009 schema", old, EventRecorder, _as_is),
        ("new", new, EventRecorder, _as_is),
    ]
    if main:
        out.insert(0, ("main", old, EventRecorder, lambda: _patched(old_ingest_metrics)))
    return out


def run(label: str, urls: tuple[str, str], points: int, batch: int, reps: int, main: bool) -> None:
    """`urls`: databases at migration 0009 and at head."""
    batches = _batches(points, batch)
    variants = _variants(*urls, main)
    best: dict[str, tuple[float, float, float]] = {}
    for _, url, recorder, patch in variants:
        with patch():
            _flush_all(url, batches[:2], recorder)  # warm up: connections, statement caches
    for _ in range(reps):
        for v, url, recorder, patch in variants:
            with patch():
                r = _flush_all(url, batches, recorder)
            best[v] = min(best.get(v, r), r, key=lambda t: t[1] + t[2])
    print(f"{label}: {points:,} points in batches of {batch}, best of {reps}")
    base = best["before"]
    for v, (wall, cpu, server) in best.items():
        print(
            f"  {v:17} {points / wall:>8,.0f} points/s wall ({base[0] / wall:4.2f}x)   "
            f"{points / (cpu + server):>8,.0f} per CPU second "
            f"({(base[1] + base[2]) / (cpu + server):4.2f}x)"
            f"   client {cpu / points * 1e6:5.2f} µs/point, server {server / points * 1e6:5.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-postgres", action="store_true")
    ap.add_argument("--main", action="store_true", help="also main's ingest (slow)")
    args = ap.parse_args()
    opts = (args.points, args.batch, args.reps, args.main)
    if not args.no_postgres:
        with (
            scratch_postgres(PG_ADMIN, PG_DB + "_0009") as old,
            scratch_postgres(PG_ADMIN, PG_DB) as new,
        ):
            downgrade(old, "0009")
            run("postgresql", (old, new), *opts)
    with tempfile.TemporaryDirectory() as d:
        old, new = f"sqlite:///{Path(d) / 'old.db'}", f"sqlite:///{Path(d) / 'new.db'}"
        upgrade(old, "0009")
        upgrade(new)
        run("sqlite", (old, new), *opts)
        dispose_engines()


if __name__ == "__main__":
    main()
