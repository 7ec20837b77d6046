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
4. the bounded fill, as the scheduler runs it: passes of at most MAX_RANKS_PER_PASS ranks
   back to back (scheduler/cycle.py run_pass), each timed, and the whole fill; rolled
   back (p50 over repeats) and once more committed pass by pass. They must place exactly
   what the one unbounded pass places.
Goals: a pass <= 100 ms; dispatch p50 <= 50 ms.

The fill pass is run old against new, alternating, on the same data: "old" is main's write
path (copied below and patched in for its passes: arrays in psycopg's text format,
attempts, assignments and the workers' claim as three statements) on main's schema of
then (a copy of the database with migration 0009 undone: no fillfactor on `jobs`, the
indexes 0009 dropped back); "new" is the code and schema as they are. Both are reported with their CPU time
besides the wall clock: this process's thread and the PostgreSQL backend's
(/proc/<pid>/schedstat: the server is local), which a shared machine's load disturbs far
less than the wall clock.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from benchlib import pct, scratch_postgres
from sqlalchemy import (
    ARRAY,
    Integer,
    String,
    any_,
    bindparam,
    create_engine,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

import torchyard.scheduler.cycle as cycle
import torchyard.store.queue as queue
import torchyard.store.states as states
from torchyard.scheduler.cycle import MAX_RANKS_PER_PASS, run_pass, schedule
from torchyard.settings import Settings
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.models import Assignment, Attempt, Job, User, Worker, utcnow
from torchyard.store.queue import FreeWorker, QueuedJob, Started
from torchyard.store.states import A_STARTING, QUEUED, STARTING
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


# main's write path (PostgreSQL only), for the old/new comparison: text-format arrays and
# a statement per table.


def _old_unnest(name: str, **columns: tuple[list[Any], TypeEngine[Any]]) -> TableValuedAlias:
    arrays = [bindparam(None, list(v), type_=ARRAY(t)) for v, t in columns.values()]
    return func.unnest(*arrays).table_valued(*columns).render_derived(name=name)


def _old_in_list(session: Session, column: Any, values: list[Any]) -> Any:
    return column == any_(bindparam(None, list(values), type_=ARRAY(column.type)))


def old_start_gangs(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[Started] | None:
    if not gangs:
        return []
    sp = session.begin_nested()
    at, ast = Attempt.__table__, Assignment.__table__
    u = _old_unnest(
        "u",
        job=([j.id for j, _ in gangs], String()),
        number=([j.attempt for j, _ in gangs], Integer()),
        size=([len(ws) for _, ws in gangs], Integer()),
    )
    rows = select(u.c.job, u.c.number, u.c.size, literal(A_STARTING))
    ins = insert(at).from_select(["job_id", "number", "world_size", "state"], rows)
    by_job = {j: a for a, j in session.execute(ins.returning(at.c.id, at.c.job_id))}
    ranks = [(by_job[j.id], j.id, r, w) for j, ws in gangs for r, w in enumerate(ws)]
    u = _old_unnest(
        "u",
        attempt=([r[0] for r in ranks], Integer()),
        job=([r[1] for r in ranks], String()),
        rank=([r[2] for r in ranks], Integer()),
        worker=([r[3].id for r in ranks], String()),
    )
    ins = insert(ast).from_select(
        ["attempt_id", "job_id", "rank", "worker_id"],
        select(u.c.attempt, u.c.job, u.c.rank, u.c.worker),
    )
    by_worker = {w: a for a, w in session.execute(ins.returning(ast.c.id, ast.c.worker_id))}
    aids = [by_worker[r[3].id] for r in ranks]
    u = _old_unnest(
        "u",
        wid=([r[3].id for r in ranks], String()),
        job=([r[1] for r in ranks], String()),
        aid=(aids, Integer()),
    )
    claim = (
        update(Worker)
        .where(Worker.state == IDLE, Worker.id == u.c.wid)
        .values(state=BUSY, current_job_id=u.c.job, current_assignment_id=u.c.aid)
        .execution_options(synchronize_session=False)
    )
    moved = [(j.id, j.attempt, f"assigned to {', '.join(w.id for w in ws)}") for j, ws in gangs]
    if session.execute(claim).rowcount != len(ranks) or not states.transition_many(  # type: ignore[attr-defined]
        session, moved, QUEUED, STARTING
    ):
        sp.rollback()
        return None
    sp.commit()
    return [Started(r[1], a, r[3].id, r[3].queue, r[2]) for a, r in zip(aids, ranks, strict=True)]


@contextmanager
def old_write_path() -> Iterator[None]:
    saved = (cycle.start_gangs, states.unnest, states.in_list, queue.unnest)
    cycle.start_gangs = old_start_gangs  # type: ignore[assignment]
    states.unnest = queue.unnest = _old_unnest  # type: ignore[assignment]
    states.in_list = _old_in_list  # type: ignore[assignment]
    try:
        yield
    finally:
        cycle.start_gangs, states.unnest, states.in_list, queue.unnest = saved  # type: ignore[assignment]


def vacuum(url: str, what: str) -> None:
    eng = create_engine(url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"VACUUM {what}"))
    eng.dispose()


# Migration 0009 undone on a copy of the current schema: its indexes back, `jobs` without
# its fillfactor. Not a downgrade to 0008: the read path (the same in both runs) needs the
# columns later migrations added (users.max_priority, jobs.hold_until, workers.warm_since,
# jobs.project_id), which a downgrade would drop.
UNDO_0009 = (
    "DROP INDEX ix_attempts_preempted_by",
    "CREATE INDEX ix_attempts_preempted_by ON attempts (preempted_by)",
    "DROP INDEX ix_jobs_sweep_id",
    "CREATE INDEX ix_jobs_sweep_id ON jobs (sweep_id)",
    "CREATE INDEX ix_attempts_job_id ON attempts (job_id)",
    "CREATE INDEX ix_assignments_attempt_id ON assignments (attempt_id)",
    "CREATE INDEX ix_jobs_queued_order ON jobs (priority DESC, created_at, id) "
    "WHERE state = 'queued'",
    "CREATE INDEX ix_jobs_owner_id ON jobs (owner_id)",
    "ALTER TABLE jobs RESET (fillfactor)",
)


@contextmanager
def old_schema_copy(admin_url: str, url: str) -> Iterator[str]:
    """A copy of the bench database with migration 0009 undone (`UNDO_0009`: its dropped
    indexes back, `jobs` without its fillfactor), dropped afterwards: its URL. Both
    databases' `jobs` are rewritten, so that each has the pages its schema makes."""
    dispose_engines()  # CREATE DATABASE … TEMPLATE needs the template unused
    name = url.rsplit("/", 1)[1]
    old_url = f"{url}_old"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}_old" TEMPLATE "{name}"'))
    try:
        eng = create_engine(old_url)
        with eng.begin() as c:
            for sql in UNDO_0009:
                c.execute(text(sql))
        eng.dispose()
        for u in (url, old_url):
            vacuum(u, "FULL ANALYZE jobs")
        yield old_url
    finally:
        dispose_engines()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}_old" WITH (FORCE)'))
        admin.dispose()


def _cpu_ms(pid: int) -> float:
    """CPU time of a local process so far, ms (nan when /proc does not have it)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e6
    except OSError:
        return math.nan


class PassTimes(NamedTuple):
    """Per pass, ms: wall clock, this thread's CPU, the server backend's CPU."""

    wall: list[float]
    client_cpu: list[float]
    server_cpu: list[float]


def timed_passes(url: str, repeats: int, *, old: bool = False) -> tuple[PassTimes, set[Any]]:
    """Passes rolled back (the state is the same for each): their times, and what the
    last one placed (job, worker, rank)."""
    t, placed = PassTimes([], [], []), set()
    for _ in range(repeats):
        with session_scope(url) as s, old_write_path() if old else nullcontext():
            dbapi = s.connection().connection.driver_connection
            pid = dbapi.info.backend_pid  # type: ignore[union-attr]
            t0, c0, s0 = time.perf_counter(), time.thread_time(), _cpu_ms(pid)
            out = schedule(s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
            t.wall.append((time.perf_counter() - t0) * 1000)
            t.client_cpu.append((time.thread_time() - c0) * 1000)
            t.server_cpu.append(_cpu_ms(pid) - s0)
            placed = {(d.job_id, d.worker_id, d.rank) for d in out}
            s.rollback()
    return t, placed


def compare_fill(url: str, old_url: str, repeats: int) -> set[Any]:
    """Old fill passes (main's code on main's schema, `old_url`) and new ones, alternating,
    on the same data; both must place the same."""
    times = {"old": PassTimes([], [], []), "new": PassTimes([], [], [])}
    urls = {"old": old_url, "new": url}
    placed: dict[str, set[Any]] = {}
    for _ in range(repeats):
        for name in times:
            # Rolled-back passes leave dead rows (1,000 workers' each): vacuumed, as
            # autovacuum would. The two databases do not fit in shared_buffers together: a
            # pass first warms its own database's pages (and statements), untimed.
            vacuum(urls[name], "workers, attempts, assignments, job_events, jobs")
            timed_passes(urls[name], 1, old=name == "old")
            t, placed[name] = timed_passes(urls[name], 2, old=name == "old")
            for mine, one in zip(times[name], t, strict=True):
                mine.extend(one)
    assert placed["old"] == placed["new"], "old and new placed differently"
    jobs = len({j for j, _, _ in placed["new"]})
    for name, t in times.items():
        report(f"fill pass, {name} ({jobs} jobs)", t.wall, PASS_GOAL_MS)
        both = [c + s for c, s in zip(t.client_cpu, t.server_cpu, strict=True)]
        print(
            f"{'':<28} cpu p50: client {statistics.median(t.client_cpu):6.1f} ms  server "
            f"{statistics.median(t.server_cpu):6.1f} ms  sum {statistics.median(both):6.1f} ms"
            f"  (min {min(both):6.1f} ms)"
        )
    return placed["new"]


def bounded_fill(url: str, *, commit: bool) -> tuple[list[float], set[Any]]:
    """The fill as the scheduler runs it: bounded passes until one is not cut short. Each
    pass is its own transaction when `commit`; else all run in one, rolled back at the end
    (a pass sees the ones before it). Per-pass wall times (ms) and what they placed."""
    times: list[float] = []
    placed: set[Any] = set()
    with session_scope(url) as s:
        more = True
        while more:
            t0 = time.perf_counter()
            out, more = run_pass(s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
            if commit:
                s.commit()
            times.append((time.perf_counter() - t0) * 1000)
            placed |= {(d.job_id, d.worker_id, d.rank) for d in out}
        if not commit:
            s.rollback()
    return times, placed


def compare_bounded(url: str, repeats: int, unbounded: set[Any]) -> None:
    per_pass: list[float] = []
    whole: list[float] = []
    for _ in range(repeats):
        vacuum(url, "workers, attempts, assignments, job_events, jobs")
        times, placed = bounded_fill(url, commit=False)
        assert placed == unbounded, "bounded passes placed differently from one pass"
        per_pass += times
        whole.append(sum(times))
    print(
        f"bounded fill: {len(times)} passes of <= {MAX_RANKS_PER_PASS} ranks, "
        f"{len(unbounded)} ranks in all"
    )
    report("  each bounded pass", per_pass, PASS_GOAL_MS)
    print(
        f"{'  the whole fill':<28} p50 {statistics.median(whole):7.1f} ms  "
        f"(one unbounded pass: see 'fill pass, new' above)"
    )


def dispatch_latency(url: str, home: Path, n: int) -> list[float]:
    """Submit (commit) -> the RUN message is in the worker's queue, one idle worker each."""
    from torchyard.scheduler.process import Scheduler

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
        with old_schema_copy(args.pg, url) as old_url:
            unbounded = compare_fill(url, old_url, args.repeats)
            compare_bounded(url, args.repeats, unbounded)
            times, placed = bounded_fill(url, commit=True)
            print(
                f"bounded fill, committed: passes {', '.join(f'{t:.1f}' for t in times)} ms "
                f"({sum(times):.1f} ms), {len(placed)} ranks assigned"
            )
            steady, _ = timed_passes(url, args.repeats * 4)
            report("steady pass (cluster full)", steady.wall, PASS_GOAL_MS)
            lat = dispatch_latency(url, Path(tmp), args.dispatches)
            report("dispatch (commit -> message)", lat, DISPATCH_GOAL_MS)
            print(f"still queued: {count(url, lambda: Job.state == QUEUED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
