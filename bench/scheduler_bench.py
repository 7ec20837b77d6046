"""The scheduler on a big cluster: 1,000 workers and 100,000 queued jobs on PostgreSQL.

    .venv/bin/python bench/scheduler_bench.py [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

Creates a fresh database (`torchyard_bench_sched`, dropped at the end; never the tests'),
registers --workers GPU workers (8 per host) and bulk-inserts --jobs queued jobs (world
sizes 1, 2, 4, 8; priorities 0-2), then measures, in this process:
1. the fill pass: one scheduling pass with every worker idle (it places a job on each),
   repeated and rolled back (p50), then once more committed;
2. the steady pass: the same on the now full cluster (no idle worker), p50;
3. dispatch: what bench/dispatch_bench.py measures from the scheduler's side. With the
   cluster full and the queue 100k deep, one worker goes idle and a job is submitted
   (inserted and committed, as the API does); the latency is from that commit to the
   RUN message written to the worker's queue by `Scheduler.schedule_pass` (pass, commit
   and send through the embedded filesystem broker). The broker's delivery and the
   worker's claim and fork are not included (dispatch_bench measures them on a real
   worker). p50 / p95.
Goals: a pass <= 100 ms; dispatch p50 <= 50 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from benchlib import pct, scratch_postgres
from sqlalchemy import create_engine, func, insert, select, text, update

from torchyard.scheduler.cycle import schedule
from torchyard.store.db import session_scope
from torchyard.store.models import Job, User, Worker, utcnow
from torchyard.store.settings import Settings
from torchyard.store.states import QUEUED
from torchyard.store.workers import BUSY, IDLE

DB_NAME = "torchyard_bench_sched"
GPU = "NVIDIA H100 80GB HBM3"
PASS_GOAL_MS, DISPATCH_GOAL_MS = 100.0, 50.0
SPEC = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd"},
    "batch_size": 64,
    "epochs": 1,
}
HEARTBEAT_TIMEOUT_S = 3600.0  # the bench's workers never beat: keep them live throughout


def populate(url: str, n_workers: int, n_jobs: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    now = utcnow()
    with session_scope(url) as s:
        owner = s.scalar(insert(User).values(name="bench").returning(User.id))
        s.execute(
            insert(Worker),
            [
                {
                    "id": f"h{i // 8:03d}-gpu{i % 8}",
                    "host": f"h{i // 8:03d}",
                    "pid": 1,
                    "gpu": i % 8,
                    "device": "cuda",
                    "device_name": GPU,
                    "queue": f"bench.worker.h{i // 8:03d}-gpu{i % 8}",
                    "state": IDLE,
                    "last_heartbeat": now,
                    "registered_at": now,
                }
                for i in range(n_workers)
            ],
        )
        for lo in range(0, n_jobs, 10_000):
            s.execute(
                insert(Job),
                [
                    {
                        "id": uuid.uuid4().hex,
                        "owner_id": owner,
                        "name": f"j{i}",
                        "spec": SPEC,
                        "world_size": rng.choices([1, 2, 4, 8], [80, 10, 6, 4])[0],
                        "priority": rng.randint(0, 2),
                        "state": QUEUED,
                        "created_at": now - timedelta(seconds=n_jobs - i),
                    }
                    for i in range(lo, min(n_jobs, lo + 10_000))
                ],
            )
    eng = create_engine(url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text("VACUUM ANALYZE"))
    eng.dispose()


def timed_passes(url: str, repeats: int) -> tuple[list[float], int]:
    """Passes rolled back (the state is the same for each): ms each, gangs placed."""
    times, placed = [], 0
    for _ in range(repeats):
        with session_scope(url) as s:
            t0 = time.perf_counter()
            out = schedule(s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
            times.append((time.perf_counter() - t0) * 1000)
            placed = len({d.job_id for d in out})
            s.rollback()
    return times, placed


def committed_pass(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with session_scope(url) as s:
        out = schedule(s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    return (time.perf_counter() - t0) * 1000, len(out)


def dispatch_latency(url: str, home: Path, n: int) -> list[float]:
    """Submit (commit) -> the RUN message is in the worker's queue, one idle worker each."""
    from torchyard.worker.scheduler import Scheduler

    settings = Settings(
        home=home,
        database_url=url,
        broker_url="filesystem://",
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        queue_prefix="bench",
    )
    sched = Scheduler(settings)
    out = []
    for i in range(n + 1):  # the first is a warm-up
        with session_scope(url) as s:
            wid = s.scalar(select(Worker.id).where(Worker.state == BUSY).limit(1))
            s.execute(
                update(Worker)
                .where(Worker.id == wid)
                .values(state=IDLE, current_job_id=None, current_assignment_id=None)
            )
        with session_scope(url) as s:
            owner = s.scalar(select(User.id))
            jid = uuid.uuid4().hex
            s.add(
                Job(
                    id=jid,
                    owner_id=owner,
                    name=f"d{i}",
                    spec=SPEC,
                    world_size=1,
                    priority=10,
                    state=QUEUED,
                )
            )
        t0 = time.perf_counter()
        sent = sched.schedule_pass("bench")
        dt = (time.perf_counter() - t0) * 1000
        assert [(d.job_id, d.worker_id) for d in sent] == [(jid, wid)], (sent, jid, wid)
        if i:
            out.append(dt)
    return out


def report(name: str, xs: list[float], goal: float) -> None:
    p50 = statistics.median(xs)
    print(
        f"{name:<28} p50 {p50:7.1f} ms  p95 {pct(xs, 95):7.1f} ms  min {min(xs):7.1f} ms  "
        f"goal {goal:.0f} ms  ratio {p50 / goal:.2f}  {'OK' if p50 <= goal else 'MISSED'}"
    )


def count(url: str, where: Callable[[], object]) -> int:
    with session_scope(url) as s:
        return int(s.scalar(select(func.count()).select_from(Job).where(where())) or 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pg",
        default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        help="an admin URL of the PostgreSQL server (its own database is created)",
    )
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dispatches", type=int, default=30)
    args = p.parse_args()
    if args.workers < 1 or args.jobs < args.workers:
        p.error("need --workers >= 1 and --jobs >= --workers")
    # Timings on a shared machine: the load says how far from an idle one they are.
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with scratch_postgres(args.pg, DB_NAME) as url, tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        populate(url, args.workers, args.jobs)
        print(
            f"{args.workers} workers, {args.jobs} queued jobs inserted in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        fill, placed = timed_passes(url, args.repeats)
        report(f"fill pass ({placed} jobs placed)", fill, PASS_GOAL_MS)
        ms, ranks = committed_pass(url)
        print(f"fill pass, committed: {ms:.1f} ms, {ranks} ranks assigned")
        steady, _ = timed_passes(url, args.repeats * 4)
        report("steady pass (cluster full)", steady, PASS_GOAL_MS)
        lat = dispatch_latency(url, Path(tmp), args.dispatches)
        report("dispatch (commit -> message)", lat, DISPATCH_GOAL_MS)
        print(f"still queued: {count(url, lambda: Job.state == QUEUED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
