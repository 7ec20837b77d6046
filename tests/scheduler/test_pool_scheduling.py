"""Sharing the pool in the scheduling pass: fair share between users, max_workers quotas
and preemption, in-process against SQLite and PostgreSQL (no broker, no trainer)."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_user, make_worker

from torchyard.scheduler import preemption
from torchyard.scheduler.cycle import PoolPolicy, schedule
from torchyard.scheduler.policy import Pools
from torchyard.store.attempts import A_HANDED_BACK, counted_failures, finish_attempt
from torchyard.store.models import Attempt, Job, JobEvent, Worker, utcnow
from torchyard.store.pool import RunningGang
from torchyard.store.queue import FreeWorker, QueuedJob
from torchyard.store.states import RUNNING, transition
from torchyard.store.usage import usage_by_user
from torchyard.store.workers import reap_stale_workers

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

TIMEOUT = 10.0
HOUR = 3600.0


def run_pass(s: Session, preempt_after_s: float = 30.0) -> list[str]:
    out = schedule(s, heartbeat_timeout_s=TIMEOUT, pool=PoolPolicy(preempt_after_s, 86_400.0))
    s.commit()
    return [d.job_id for d in out]


def reason(s: Session, job: Job) -> str:
    s.refresh(job)
    return job.pending_reason or ""


def past_usage(s: Session, owner: str, hours: float, ended_ago_s: float = 0.0) -> None:
    """A finished one-worker job of `owner` that ran for `hours`, ending `ended_ago_s` ago."""
    job = make_job(s, owner=owner, state="succeeded", age_s=hours * HOUR + ended_ago_s + 1)
    end = utcnow() - timedelta(seconds=ended_ago_s)
    s.add(
        Attempt(
            job_id=job.id,
            number=1,
            state="succeeded",
            world_size=1,
            created_at=end - timedelta(hours=hours),
            started_at=end - timedelta(hours=hours),
            ended_at=end,
        )
    )
    s.flush()


def running(s: Session, job: Job, started_ago_s: float = 60.0) -> None:
    """Start `job` on idle workers (one pass) and mark its attempt and itself running."""
    assert job.id in run_pass(s)
    att = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    att.state, att.started_at = "running", utcnow() - timedelta(seconds=started_ago_s)
    s.refresh(job)
    transition(s, job, RUNNING, reason="test")
    s.commit()


def test_usage_is_worker_seconds_decayed_by_the_half_life(session: Session) -> None:
    s = session
    past_usage(s, "alice", 2.0)
    past_usage(s, "bob", 2.0, ended_ago_s=86_400.0)
    s.commit()
    ids = {u: make_user(s, u).id for u in ("alice", "bob")}
    use = usage_by_user(s, utcnow(), 86_400.0)
    # 2 h just ended: the integral of 2^(-age/half-life) over those 7200 s.
    k = math.log(2) / 86_400.0
    assert use[ids["alice"]] == pytest.approx((1 - math.exp(-k * 7200)) / k, rel=1e-3)
    assert use[ids["bob"]] == pytest.approx(use[ids["alice"]] / 2, rel=0.01)


def test_the_user_who_used_less_goes_first(session: Session) -> None:
    s = session
    past_usage(s, "alice", 3.0)
    past_usage(s, "bob", 0.5)
    a1 = make_job(s, owner="alice", age_s=100)
    a2 = make_job(s, owner="alice", age_s=90)
    b1 = make_job(s, owner="bob", age_s=10)
    make_worker(s, "w1")
    s.commit()
    assert run_pass(s) == [b1.id]
    why = reason(s, a1)
    # 3 h (decayed a little: 2.9) against 0.5 h
    assert why.startswith("fair share: alice has used 2.9 CPU slot-h, bob 0.5 ("), why
    assert "queued behind 1 job" not in why and "needs 1 worker, 0 idle" in why
    assert reason(s, a2).endswith("queued behind 1 job")


def test_priority_beats_fair_share_and_share_divides_usage(session: Session) -> None:
    s = session
    past_usage(s, "alice", 4.0)
    past_usage(s, "bob", 1.5)
    make_user(s, "alice").share = 4.0  # 4 h over share 4 = 1 < bob's 1.5
    bob_urgent = make_job(s, owner="bob", priority=1, age_s=1)
    alice = make_job(s, owner="alice", age_s=50)
    bob = make_job(s, owner="bob", age_s=100)
    make_worker(s, "w1")
    make_worker(s, "w2")
    s.commit()
    assert run_pass(s) == [bob_urgent.id, alice.id]
    why = reason(s, bob)
    assert why.startswith("fair share: bob has used 1.5 CPU slot-h (share 1), alice 3.8 (share 4)")


def test_max_workers_holds_a_user_back_and_names_the_limit(session: Session) -> None:
    s = session
    make_user(s, "alice").max_workers = 1
    make_worker(s, "w1")
    first = make_job(s, owner="alice", age_s=100)
    running(s, first)
    second = make_job(s, owner="alice", age_s=90)
    too_big = make_job(s, owner="alice", world_size=2, age_s=80)
    bob = make_job(s, owner="bob", age_s=1)
    make_worker(s, "w2")
    make_worker(s, "w3")
    s.commit()
    assert run_pass(s) == [bob.id]
    assert reason(s, second) == "quota: alice's jobs hold 1 of max_workers 1, this one needs 1"
    assert "quota: needs 2 workers but alice's max_workers is 1" in reason(s, too_big)


def test_preemption_stops_the_newest_lowest_and_hands_the_workers_over(
    session: Session,
) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2")
    old_low = make_job(s, owner="bob", priority=-1, age_s=500)
    running(s, old_low, started_ago_s=400)
    new_low = make_job(s, owner="bob", priority=-1, age_s=300)
    running(s, new_low, started_ago_s=200)
    urgent = make_job(s, owner="alice", priority=5, age_s=10)
    s.commit()
    assert run_pass(s) == []  # not waited preempt_after_s yet: it says whom, and when
    said = reason(s, urgent)
    assert f"; will preempt 1 job: {new_low.id} (priority -1) at " in said, said
    assert re.search(r" UTC, in (19|20)s \(TORCHYARD_PREEMPT_AFTER_S\)", said), said
    assert s.scalars(select(Attempt.preempted_by).where(Attempt.job_id == new_low.id)).one() is None
    assert run_pass(s, preempt_after_s=5) == []
    assert reason(s, urgent).startswith(f"preempting 1 job for 1 worker: {new_low.id}")
    victim = s.scalars(select(Attempt).where(Attempt.job_id == new_low.id)).one()
    s.refresh(victim)
    assert victim.preempted_by == urgent.id
    event = s.scalars(select(JobEvent).where(JobEvent.type == "preempted")).one()
    assert (event.job_id, event.data["by"]) == (new_low.id, urgent.id)
    # In flight: no second victim, and the reason says what it waits for.
    assert run_pass(s, preempt_after_s=5) == []
    assert reason(s, urgent).startswith(f"waiting for preempted job {new_low.id} to stop")
    s.refresh(old_low)
    assert s.scalars(select(Attempt.preempted_by).where(Attempt.job_id == old_low.id)).one() is None
    # The victim's trainer checkpointed and exited: handed back, not counted.
    finish_attempt(s, victim.id, A_HANDED_BACK, exit_code=75, reason=f"preempted by {urgent.id}")
    w = s.get(Worker, s.scalars(select(Worker.id).where(Worker.current_job_id == new_low.id)).one())
    w.state, w.current_job_id, w.current_assignment_id = "idle", None, None
    s.commit()
    s.refresh(new_low)
    assert (new_low.state, new_low.attempt) == ("queued", 2)
    assert new_low.pending_reason == f"preempted by job {urgent.id}; resumes from its checkpoint"
    assert run_pass(s, preempt_after_s=5) == [urgent.id]


def test_a_victim_whose_worker_dies_while_stopping_is_handed_back_not_counted(
    session: Session,
) -> None:
    s = session
    make_worker(s, "w1")
    low = make_job(s, owner="bob", priority=-1, age_s=300)
    running(s, low, started_ago_s=200)
    urgent = make_job(s, owner="alice", priority=5, age_s=10)
    s.commit()
    run_pass(s, preempt_after_s=5)
    victim = s.scalars(select(Attempt).where(Attempt.job_id == low.id)).one()
    s.refresh(victim)
    assert victim.preempted_by == urgent.id
    # The worker goes silent before its trainer has exited; the reaper ends the attempt.
    w = s.get(Worker, "w1")
    w.last_heartbeat = utcnow() - timedelta(seconds=600)
    s.commit()
    assert reap_stale_workers(s, timeout_s=60) == [("w1", [low.id])]
    s.commit()
    s.refresh(victim)
    s.refresh(low)
    assert victim.state == A_HANDED_BACK
    assert "lost (no heartbeat for 60s) while preempted by job" in (victim.reason or "")
    assert (low.state, low.attempt, counted_failures(s, low.id)) == ("queued", 2, 0)
    assert low.pending_reason == f"preempted by job {urgent.id}; resumes from its checkpoint"


def test_equal_priority_and_non_preemptible_jobs_are_never_preempted(session: Session) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2")
    same = make_job(s, owner="bob", priority=3, age_s=500)
    running(s, same)
    pinned = make_job(s, owner="bob", priority=0, age_s=400, preemptible=False)
    running(s, pinned)
    urgent = make_job(s, owner="alice", priority=3, age_s=100)
    s.commit()
    assert run_pass(s, preempt_after_s=0) == []
    assert s.scalars(select(Attempt).where(Attempt.preempted_by.is_not(None))).all() == []
    assert reason(s, urgent) == "needs 1 worker, 0 idle"


def _gang(job: str, workers: int, priority: int, started_s: float) -> RunningGang:
    return RunningGang(
        job, hash(job) % 1000, 1, priority, datetime.fromtimestamp(started_s).astimezone(),
        "cpu", None, workers,
    )  # fmt: skip


def test_the_fewest_then_lowest_then_newest_victims_are_chosen() -> None:
    now = utcnow()
    job = QueuedJob("big", 2, now, 1, None, 1, 10)
    live = {("cpu", ""): 4}
    gangs = [_gang("a", 1, 0, 100), _gang("b", 1, 0, 200), _gang("pair", 2, 1, 50)]
    # One 2-worker job beats two 1-worker jobs, even at a higher priority.
    got = preemption.choose([job], Pools([]), gangs, live)
    assert [p.victim_job_id for p in got.preemptions] == ["pair"]
    # One idle worker: the newest of the lowest single jobs is enough.
    idle = [FreeWorker("w0", "h", "cpu", None, "q")]
    got = preemption.choose([job], Pools(idle), gangs, live)
    assert [p.victim_job_id for p in got.preemptions] == ["b"]
    # Nothing of lower priority: no victims.
    got = preemption.choose([job._replace(priority=0)], Pools([]), gangs, live)
    assert got.preemptions == []
