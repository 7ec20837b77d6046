"""Metric ingest speed through the worker's flush (worker/events.py: EventRecorder.write,
then commit, as the supervisor does), old path against new, on PostgreSQL and SQLite.

    .venv/bin/python bench/ingest_bench.py [--points 60000] [--batch 1000] [--no-postgres]

"old" is the flush with main's ingest (copied below and patched in for its run: a
SQLAlchemy-built multi-row `INSERT … ON CONFLICT`, then two rollup statements per series);
"new" is the flush as it is (store/ingest.py). Both write three series, in batches of
`--batch` points, each batch fenced and committed with its events offset and rollups.
Wall clock counts waiting for a shared machine's CPUs; the CPU seconds of this process and
of the database server's backends do not. PostgreSQL runs in a database of its own on
127.0.0.1:5432 (`torchyard_bench_ingest`, created and dropped here); SQLite in a temporary
file."""

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
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

import torchyard.worker.events as worker_events
from torchyard.store.auth import get_or_create_user
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import upgrade
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


def _flush_all(url: str, batches: list[list[dict[str, Any]]]) -> tuple[float, float]:
    """Seconds spent in the flushes (write + commit) of every batch, for a new job: wall
    clock, and CPU (this process's and the database server's)."""
    job_id, attempt_id = _job(url)
    server = _server_cpu(url)
    wall = cpu = 0.0
    offset = 0
    for b in batches:
        rec = EventRecorder(job_id, attempt_id, 1)
        for ev in b:
            rec.add(ev)
        offset += len(b) * 100
        rec.offset = offset
        t0, c0, s0 = time.perf_counter(), time.process_time(), server()
        with session_scope(url) as s:
            rec.write(s)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0 + server() - s0
    with session_scope(url) as s:
        n = s.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id))
    assert n == sum(map(len, batches)), n
    return wall, cpu


@contextmanager
def _patched(ingest: Callable[..., int]) -> Iterator[None]:
    saved = worker_events.ingest_metrics
    worker_events.ingest_metrics = ingest  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_events.ingest_metrics = saved  # type: ignore[assignment]


def run(label: str, url: str, points: int, batch: int) -> None:
    upgrade(url)
    batches = _batches(points, batch)
    _flush_all(url, batches[:2])  # warm up: connections, statement caches
    with _patched(old_ingest_metrics):
        old, old_cpu = _flush_all(url, batches)
    new, new_cpu = _flush_all(url, batches)
    print(
        f"{label:10} old {points / old:>8,.0f} points/s   new {points / new:>8,.0f} points/s"
        f"   new/old {old / new:5.1f}x   ({points:,} points, batches of {batch})\n"
        f"{'':10} per CPU second (client + server): old {points / old_cpu:>8,.0f}   "
        f"new {points / new_cpu:>8,.0f}   new/old {old_cpu / new_cpu:5.1f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    if not args.no_postgres:
        with scratch_postgres(PG_ADMIN, PG_DB) as url:
            run("postgresql", url, args.points, args.batch)
    with tempfile.TemporaryDirectory() as d:
        run("sqlite", f"sqlite:///{Path(d) / 'bench.db'}", args.points, args.batch)
        dispose_engines()


if __name__ == "__main__":
    main()
