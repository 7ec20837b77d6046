"""The scheduling pass, the lease, attempt endings and the reaper, in-process against
SQLite and PostgreSQL (no broker, no trainer)."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support.backends import only
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.scheduler.policy import cluster_reason, kind_of, plan, plural
from torchyard.scheduler.process import Scheduler
from torchyard.settings import Settings
from torchyard.store.attempts import (
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_SUCCEEDED,
    claim_assignment,
    claim_rank,
    finish_attempt,
    job_and_attempt_state,
)
from torchyard.store.db import session_factory, session_scope
from torchyard.store.models import Assignment, Attempt, Job, JobEvent, Worker, utcnow
from torchyard.store.queue import FreeWorker, QueuedJob, start_gangs
from torchyard.store.states import CANCELLING, transition
from torchyard.store.workers import (
    WorkerInfo,
    reap_stale_workers,
    register_worker,
    release_orphaned_workers,
    release_worker,
)

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

TIMEOUT = 10.0


def run_pass(s: Session, **kw: float) -> list:
    out = schedule(s, heartbeat_timeout_s=TIMEOUT, **kw)
    s.commit()
    return out


def reason(s: Session, job: Job) -> str | None:
    s.refresh(job)
    return job.pending_reason


def test_gang_is_all_or_nothing_and_a_big_job_does_not_block(session: Session) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2")
    big = make_job(s, world_size=3, age_s=10)
    small = make_job(s, world_size=1, age_s=5)
    pair = make_job(s, world_size=2, age_s=1)
    out = run_pass(s)
    # The 3-worker job cannot run on 2 workers; the small one behind it starts anyway.
    assert [d.job_id for d in out] == [small.id]
    assert reason(s, big) == "needs 3 workers, 2 registered"
    assert reason(s, pair) == "needs 2 workers, 1 idle"
    s.refresh(small)
    assert small.state == "starting"
    assert s.scalar(select(func.count()).select_from(Assignment)) == 1
    # Free the worker: the pair now takes both at once.
    release_worker(s, out[0].worker_id, out[0].assignment_id)
    s.commit()
    out2 = run_pass(s)
    assert sorted(d.rank for d in out2) == [0, 1]
    assert {d.worker_id for d in out2} == {"w1", "w2"}
    assert len({d.job_id for d in out2}) == 1 and out2[0].job_id == pair.id
    assert reason(s, big) == "needs 3 workers, 2 registered"


def test_priority_then_age_and_reasons(session: Session) -> None:
    s = session
    old_low = make_job(s, priority=0, age_s=100)
    new_high = make_job(s, priority=5, age_s=1)
    mid = make_job(s, priority=0, age_s=50)
    run_pass(s)
    assert reason(s, old_low) == "no worker registered"
    make_worker(s, "w1")
    out = run_pass(s)
    assert [d.job_id for d in out] == [new_high.id]
    assert reason(s, old_low) == "needs 1 worker, 0 idle"
    assert reason(s, mid) == "queued behind 1 job"


def test_stale_and_busy_workers_are_not_scheduled(session: Session) -> None:
    s = session
    make_worker(s, "stale", heartbeat=utcnow() - timedelta(seconds=TIMEOUT * 2))
    make_worker(s, "busy", state="busy")
    job = make_job(s)
    assert run_pass(s) == []
    assert reason(s, job) == "needs 1 worker, 0 idle"


def test_a_long_waiting_job_reserves_workers(session: Session) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2", state="busy")
    waiting = make_job(s, world_size=2, age_s=1000)
    small = make_job(s, world_size=1, age_s=1)
    out = run_pass(s, reserve_after_s=600)
    assert out == []  # the idle worker is kept for the starving gang job
    assert "reserving" in (reason(s, waiting) or "")
    assert reason(s, small) == "queued behind 1 job"
    # Without starvation the small job backfills.
    out = run_pass(s, reserve_after_s=5000)
    assert [d.job_id for d in out] == [small.id]


def test_the_lease_starts_one_trainer_per_assignment(session: Session) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2")
    make_job(s)
    (d,) = run_pass(s)
    other = "w2" if d.worker_id == "w1" else "w1"
    assert claim_assignment(s, d.assignment_id, other) is None  # not its assignment
    assert claim_assignment(s, d.assignment_id, d.worker_id) is not None
    s.commit()
    assert claim_assignment(s, d.assignment_id, d.worker_id) is None  # duplicate message


def test_claim_rank_gives_the_worker_its_rank_once(session: Session) -> None:
    s = session
    make_worker(s, "w0")
    make_worker(s, "w1")
    job = make_job(s, world_size=2)
    out = run_pass(s)
    d = next(d for d in out if d.rank == 1)
    c = claim_rank(s, d.assignment_id, d.worker_id)
    assert c is not None and (c.job_id, c.rank, c.world_size, c.attempt_number) == (job.id, 1, 2, 1)
    assert c.spec == job.spec and not c.cancelling
    assert claim_rank(s, d.assignment_id, d.worker_id) is None  # a duplicate message
    assert job_and_attempt_state(s, c.attempt_id) == ("starting", "starting")
    assert job_and_attempt_state(s, 10_000) == (None, None)
    # A cancel that came before the claim: the rank learns it at once.
    s.refresh(job)
    transition(s, job, CANCELLING)
    d0 = next(d for d in out if d.rank == 0)
    c0 = claim_rank(s, d0.assignment_id, d0.worker_id)
    assert c0 is not None and c0.cancelling


def test_a_batch_that_lost_a_race_writes_nothing(session: Session) -> None:
    """start_gangs is all or nothing: a worker taken under the pass undoes the whole batch."""
    s = session
    make_worker(s, "w0")
    make_worker(s, "w1", state="busy")  # idle when the pass read it, busy since
    a, b = make_job(s, age_s=2), make_job(s, age_s=1)
    s.commit()
    free = [FreeWorker(w, "h1", "cpu", None, f"q.{w}") for w in ("w0", "w1")]
    gangs = [
        (QueuedJob(j.id, 1, j.created_at, 1, None), [w]) for j, w in zip((a, b), free, strict=True)
    ]
    assert start_gangs(s, gangs) is None
    s.commit()
    assert s.scalar(select(func.count()).select_from(Attempt)) == 0
    assert s.scalar(select(func.count()).select_from(Assignment)) == 0
    s.refresh(a)
    s.refresh(b)
    assert (a.state, b.state) == ("queued", "queued")
    assert s.get(Worker, "w0", populate_existing=True).state == "idle"  # type: ignore[union-attr]
    # Without the interloper the same batch goes through.
    assert [x.worker_id for x in start_gangs(s, gangs[:1]) or []] == ["w0"]


def test_a_batch_writes_rows_that_agree(session: Session) -> None:
    """Every rank's assignment is its job's new attempt's, its worker holds it, the events
    name the workers; worker ids and reasons with quotes, backslashes, commas and non-ASCII
    go through the batch arrays intact (binary on PostgreSQL)."""
    s = session
    odd = ['w"0', "w\\1", "w, 2", "wé 3", "w{4}", "NULL"]
    for w in odd:
        make_worker(s, w)
    jobs = [make_job(s, world_size=n, age_s=10 - i) for i, n in enumerate((2, 1, 3))]
    late = make_job(s, world_size=2, age_s=1)
    out = run_pass(s)
    assert sorted(d.worker_id for d in out) == sorted(odd)
    assert reason(s, late) == "needs 2 workers, 0 idle"
    for d in out:
        a = s.get(Assignment, d.assignment_id)
        assert a is not None and (a.job_id, a.worker_id, a.rank) == (d.job_id, d.worker_id, d.rank)
        att = s.get(Attempt, a.attempt_id)
        assert att is not None and (att.job_id, att.number, att.state) == (d.job_id, 1, "starting")
        w = s.get(Worker, d.worker_id, populate_existing=True)
        assert w is not None and w.state == "busy"
        assert (w.current_job_id, w.current_assignment_id) == (d.job_id, d.assignment_id)
    for job in jobs:
        s.refresh(job)
        ranks = sorted((d.rank, d.worker_id) for d in out if d.job_id == job.id)
        assert job.state == "starting" and len(ranks) == job.world_size
        (ev,) = s.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()
        assert ev.data == {
            "from": "queued",
            "to": "starting",
            "reason": "assigned to " + ", ".join(w for _, w in ranks),
            "attempt": 1,
        }


def _start(s: Session, world_size: int = 1, max_restarts: int = 2) -> tuple[Job, Attempt]:
    for i in range(world_size):
        if s.get(Worker, f"w{i}") is None:
            make_worker(s, f"w{i}")
    job = make_job(s, world_size=world_size, max_restarts=max_restarts)
    run_pass(s)
    s.refresh(job)
    attempt = s.scalars(
        select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
    ).one()
    return job, attempt


def test_attempt_endings_move_the_job(session: Session) -> None:
    s = session
    job, att = _start(s, max_restarts=1)
    # A hand-back (stopping worker) does not count against max_restarts...
    assert finish_attempt(s, att.id, A_HANDED_BACK, reason="stop") == "queued"
    assert finish_attempt(s, att.id, A_SUCCEEDED) is None  # ends once
    s.commit()
    release_orphaned_workers(s, grace_s=0)
    for w in s.scalars(select(Worker)):
        s.refresh(w)
    s.commit()
    job2, att2 = job, None
    run_pass(s)
    s.refresh(job2)
    assert job2.attempt == 2 and job2.state == "starting"
    att2 = s.scalars(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == 2)).one()
    # ...a lost attempt does, and with max_restarts=1 one loss is retried...
    assert finish_attempt(s, att2.id, A_LOST, reason="gone") == "queued"
    s.commit()
    release_orphaned_workers(s, grace_s=0)
    s.commit()
    run_pass(s)
    att3 = s.scalars(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == 3)).one()
    # ...and the second counted failure fails the job with the reason.
    assert finish_attempt(s, att3.id, A_FAILED, reason="boom", error="internal: boom") == "failed"
    s.commit()
    s.refresh(job)
    assert job.state == "failed" and "internal: boom" in (job.error or "")
    assert "max_restarts=1" in (job.error or "")


def test_deterministic_error_and_cancel(session: Session) -> None:
    s = session
    job, att = _start(s)
    assert (
        finish_attempt(s, att.id, A_FAILED, error="nonfinite_loss: nan", retryable=False)
        == "failed"
    )
    s.refresh(job)
    assert job.error == "nonfinite_loss: nan" and job.attempt == 1
    s.commit()
    release_orphaned_workers(s, grace_s=0)
    s.commit()
    job, att = _start(s)
    transition(s, job, CANCELLING)
    s.commit()
    # Whatever ended the trainer, a cancelling job ends cancelled.
    assert finish_attempt(s, att.id, A_LOST, reason="SIGTERM") == "cancelled"


def test_reaper_requeues_then_fails(session: Session) -> None:
    s = session
    job, att = _start(s, max_restarts=0)
    assert reap_stale_workers(s, TIMEOUT) == []  # fresh heartbeats: nothing to reap
    later = utcnow() + timedelta(seconds=TIMEOUT + 1)
    reaped = reap_stale_workers(s, TIMEOUT, now=later)
    s.commit()
    assert reaped == [("w0", [job.id])]
    s.refresh(job)
    s.refresh(att)
    assert att.state == "lost" and "no heartbeat" in (att.reason or "")
    assert job.state == "failed" and "max_restarts=0" in (job.error or "")
    assert s.get(Worker, "w0").state == "lost"  # type: ignore[union-attr]


def test_a_lost_worker_names_no_job_once_it_runs_elsewhere(session: Session) -> None:
    """The reaper's lost worker shows no current job (the workers page listed the job it
    had, by then running on another worker), yet keeps its assignment's lease: should it
    come back and end that assignment, it is released to idle as before."""
    s = session
    job, att = _start(s)
    asg = s.scalars(select(Assignment).where(Assignment.attempt_id == att.id)).one()
    later = utcnow() + timedelta(seconds=TIMEOUT + 1)
    assert reap_stale_workers(s, TIMEOUT, now=later) == [("w0", [job.id])]
    s.commit()
    make_worker(s, "w1")
    run_pass(s)
    s.refresh(job)
    assert job.attempt == 2 and job.state == "starting"
    w0, w1 = s.get(Worker, "w0"), s.get(Worker, "w1")
    assert w0 is not None and w1 is not None
    s.refresh(w0)
    assert (w0.state, w0.current_job_id) == ("lost", None)
    assert (w1.state, w1.current_job_id) == ("busy", job.id)
    assert release_worker(s, "w0", asg.id)  # back from lost, on the lease it still holds
    s.commit()
    s.refresh(w0)
    assert w0.state == "idle"


def test_restarted_worker_loses_its_old_attempt_at_once(session: Session) -> None:
    s = session
    job, _ = _start(s)
    lost = register_worker(s, WorkerInfo(id="w0", host="h1", pid=2, queue="q.w0"))
    s.commit()
    assert lost == [job.id]
    s.refresh(job)
    assert job.state == "queued" and job.attempt == 2
    w = s.get(Worker, "w0")
    assert w is not None and w.state == "idle" and w.current_assignment_id is None


def _check_no_double_assignment(url: str) -> tuple[int, int]:
    with session_scope(url) as s:
        per_worker = s.execute(
            select(Assignment.worker_id, func.count())
            .join(Attempt, Attempt.id == Assignment.attempt_id)
            .where(Attempt.state.in_(("starting", "running")))
            .group_by(Assignment.worker_id)
        ).all()
        assert all(n == 1 for _, n in per_worker), per_worker
        per_job = s.execute(select(Attempt.job_id, func.count()).group_by(Attempt.job_id)).all()
        assert all(n == 1 for _, n in per_job), per_job
        busy = s.scalar(select(func.count()).select_from(Worker).where(Worker.state == "busy"))
        started = s.scalar(
            select(func.coalesce(func.sum(Job.world_size), 0)).where(Job.state == "starting")
        )
        assert busy == started == len(per_worker)
        return len(per_worker), len(per_job)


def _race(url: str, n_workers: int, n_jobs: int, schedulers: int) -> tuple[int, int]:
    rng = random.Random(7)
    with session_scope(url) as s:
        for i in range(n_workers):
            make_worker(s, f"w{i:02d}", host=f"h{i % 3}")
        for i in range(n_jobs):
            make_job(s, world_size=rng.choice([1, 1, 2, 3]), priority=rng.randint(0, 2), age_s=i)
    barrier = threading.Barrier(schedulers)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            maker = session_factory(url)
            barrier.wait()
            for _ in range(15):
                with maker() as s:
                    schedule(s, heartbeat_timeout_s=TIMEOUT)
                    s.commit()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(schedulers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return _check_no_double_assignment(url)


@only("postgres")
def test_two_schedulers_never_double_assign_on_postgres(db_url: str) -> None:
    busy, jobs = _race(db_url, n_workers=24, n_jobs=60, schedulers=2)
    assert busy == 24 or jobs == 60  # the pool is filled as far as the queue allows
    assert busy > 20


def test_two_schedulers_never_double_assign_on_sqlite(sqlite_url: str) -> None:
    busy, _ = _race(sqlite_url, n_workers=12, n_jobs=30, schedulers=2)
    assert busy > 9


def _register(s: Session, wid: str, device: str = "cpu", name: str | None = None) -> None:
    # The worker's real registration path, reporting a GPU without touching CUDA.
    gpu = 0 if device == "cuda" else None
    info = WorkerInfo(id=wid, host="h1", pid=2, queue=f"q.{wid}", device=device, gpu=gpu,
                      device_name=name)  # fmt: skip
    register_worker(s, info)
    s.commit()


def test_a_gang_never_mixes_cpu_and_gpu_workers_or_gpu_models(session: Session) -> None:
    s = session
    _register(s, "cpu0")
    _register(s, "gpu0", "cuda", "NVIDIA H100 80GB HBM3")
    pair = make_job(s, world_size=2, age_s=5)
    assert run_pass(s) == []
    why = reason(s, pair)
    assert why is not None and "of one kind" in why and "never mixes CPU and GPU" in why
    assert "1 cpu" in why and "1 NVIDIA H100 80GB HBM3" in why
    # Another GPU of another model: still no gang of two alike.
    _register(s, "gpu1", "cuda", "Tesla V100-SXM2-16GB")
    assert run_pass(s) == []
    # A second H100: the pair runs on the two H100s, never on the CPU or the V100.
    _register(s, "gpu2", "cuda", "NVIDIA H100 80GB HBM3")
    out = run_pass(s)
    assert {d.worker_id for d in out} == {"gpu0", "gpu2"} and {d.job_id for d in out} == {pair.id}


def test_two_cpu_workers_gang_while_a_gpu_is_idle(session: Session) -> None:
    s = session
    _register(s, "gpu0", "cuda", "NVIDIA H100 80GB HBM3")
    _register(s, "cpu0")
    _register(s, "cpu1")
    single = make_job(s, world_size=1, age_s=6)
    pair = make_job(s, world_size=2, age_s=5)
    out = run_pass(s)
    by_job = {d.job_id: set() for d in out}
    for d in out:
        by_job[d.job_id].add(d.worker_id)
    # The one-rank job takes the kind with the fewest idle (the lone GPU), keeping the
    # CPU pair whole for the job that needs two alike.
    assert by_job == {single.id: {"gpu0"}, pair.id: {"cpu0", "cpu1"}}


# ---- the policy alone (no database): the fast pools against a plain re-scan reference --


def _reference_plan(jobs, free, live_kinds, now, reserve_after_s):  # type: ignore[no-untyped-def]
    """The policy written the slow, obvious way: regroup the idle list for every job."""
    kinds_order = sorted({kind_of(w.device, w.device_name) for w in free})
    gangs, reasons, waiting = [], {}, 0

    def by(key, ws):  # type: ignore[no-untyped-def]
        out: dict = {}
        for w in ws:
            out.setdefault(key(w), []).append(w)
        return out

    for job in jobs:
        n = job.world_size
        reason = cluster_reason(n, live_kinds)
        if reason is None:
            pools = by(lambda w: kind_of(w.device, w.device_name), free)
            fitting = [k for k in kinds_order if len(pools.get(k, [])) >= n]
            if fitting:
                hosts = by(lambda w: w.host, pools[min(fitting, key=lambda k: (len(pools[k]), k))])
                fit = [ws for ws in hosts.values() if len(ws) >= n]
                chosen = min(fit, key=len)[:n] if fit else []
                for ws in [] if fit else sorted(hosts.values(), key=len, reverse=True):
                    chosen += ws[: n - len(chosen)]
                gangs.append((job, chosen))
                free = [w for w in free if w not in chosen]
                continue
            sizes = [len(pools.get(k, [])) for k in kinds_order]
            most = max(sizes, default=0)
            if waiting:
                reason = f"queued behind {plural(waiting, 'job')}"
            elif len(free) >= n:
                reason = (f"needs {plural(n, 'worker')} of one kind, {len(free)} idle but at "
                          f"most {most} of one kind")  # fmt: skip
            else:
                reason = f"needs {plural(n, 'worker')}, {len(free)} idle"
            if (now - job.created_at).total_seconds() > reserve_after_s:
                k = kinds_order[sizes.index(most)] if most else None
                kept = pools.get(k, [])[:n]
                free = [w for w in free if w not in kept]
                reason += " (reserving workers)"
            waiting += 1
        if job.pending_reason != reason:
            reasons[job.id] = reason
    return [(j.id, [w.id for w in ws]) for j, ws in gangs], reasons


def _pool(workers: list) -> tuple[list[FreeWorker], dict]:
    """Idle workers from (host, model) pairs in the store's order, and live counts by kind."""
    free = sorted(
        (FreeWorker(f"w{i:02d}", f"h{h}", "cpu" if d == "cpu" else "cuda", None if d == "cpu"
                    else d, f"q{i}") for i, (h, d) in enumerate(workers)),
        key=lambda w: (w.host, w.id),
    )  # fmt: skip
    live: dict = {}
    for w in free:
        live[kind_of(w.device, w.device_name)] = live.get(kind_of(w.device, w.device_name), 0) + 1
    return free, live


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["cpu", "a100", "h100"])), max_size=30
    ),
    jobs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 600)), max_size=25),
)
def test_the_policy_matches_the_plain_reference(workers: list, jobs: list) -> None:
    now = utcnow()
    free, live = _pool(workers)
    queued = [QueuedJob(f"j{i:02d}", n, now - timedelta(seconds=age), 1, None)
              for i, (n, age) in enumerate(jobs)]  # fmt: skip
    # plan() orders the queue itself (priority, fair share, age); the reference walks it
    # in that order, which with one user and one priority is age.
    queued.sort(key=lambda j: (j.created_at, j.id))
    got = plan(queued, free, live, now=now, reserve_after_s=300)
    want = _reference_plan(queued, free, live, now, 300)
    assert ([(j.id, [w.id for w in ws]) for j, ws in got.gangs], got.reasons) == want


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["cpu", "a100", "h100"])), max_size=30
    ),
    jobs=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 600), st.integers(0, 1)), max_size=25
    ),
    max_ranks=st.integers(1, 8),
)
def test_bounded_passes_start_what_one_unbounded_pass_starts(
    workers: list, jobs: list, max_ranks: int
) -> None:
    """Passes of at most `max_ranks` ranks, each on what the previous left (as the
    scheduler runs them back to back), start the same gangs on the same workers, in the
    same order, as one unbounded pass."""
    now = utcnow()
    free, live = _pool(workers)
    queued = [QueuedJob(f"j{i:02d}", n, now - timedelta(seconds=age), 1, None, 0, prio)
              for i, (n, age, prio) in enumerate(jobs)]  # fmt: skip
    whole = plan(queued, free, live, now=now, reserve_after_s=300)
    got: list = []
    for _ in range(len(queued) + 1):
        p = plan(queued, free, live, now=now, reserve_after_s=300, max_ranks=max_ranks)
        assert sum(len(ws) for _, ws in p.gangs) < max_ranks + 6  # one gang may cross it
        got += p.gangs
        taken = {w.id for _, ws in p.gangs for w in ws}
        started = {j.id for j, _ in p.gangs}
        free = [w for w in free if w.id not in taken]
        queued = [j for j in queued if j.id not in started]
        if not p.truncated:
            break
    else:
        raise AssertionError("bounded passes did not finish")
    assert [(j.id, [w.id for w in ws]) for j, ws in got] == [
        (j.id, [w.id for w in ws]) for j, ws in whole.gangs
    ]


def test_the_scheduler_sends_each_bounded_pass_before_running_the_next(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill bigger than max_ranks takes several passes, each committed and its messages
    sent before the next pass starts anything."""
    with session_scope(db_url) as s:
        for i in range(7):
            make_worker(s, f"w{i}")
        jobs = [make_job(s, age_s=10 - i).id for i in range(7)]
    sched = Scheduler(
        Settings(_env_file=None, database_url=db_url, home=tmp_path),  # type: ignore[call-arg]
        max_ranks=3,
    )
    committed_at_send: list[int] = []

    def send(assignment_id: int, queue: str) -> bool:
        with session_scope(db_url) as s:
            committed_at_send.append(s.scalar(select(func.count()).select_from(Assignment)))
        return True

    monkeypatch.setattr(sched, "_send", send)
    out = sched.schedule_pass()
    assert [d.job_id for d in out] == jobs  # oldest first, all of them
    assert committed_at_send == [3, 3, 3, 6, 6, 6, 7]
