"""Hostile tenants and preemption (issue 25, "Any user can preempt everyone"): a job of a
user who was given no higher max_priority never preempts another user's work, whatever
priority it carries; a user still orders their own jobs; a user an admin raised preempts
only the users below them. In-process scheduling passes on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_user, make_worker
from test_pool_scheduling import reason, run_pass, running

from torchyard.scheduler import preemption
from torchyard.scheduler.policy import Pools
from torchyard.store.models import Attempt, utcnow
from torchyard.store.pool import RunningGang
from torchyard.store.queue import QueuedJob

pytestmark = pytest.mark.hostile


def _preempted(s: Session) -> dict[str, str | None]:
    rows = s.execute(select(Attempt.job_id, Attempt.preempted_by)).all()
    return {job: by for job, by in rows if by is not None}


def test_a_default_user_never_preempts_another_users_low_priority_job(session: Session) -> None:
    """Bob orders his own work with a low priority: that must not hand his workers to
    anyone who submits at the default priority (before: alice's 0 preempted bob's -5)."""
    s = session
    make_worker(s, "w1")
    bobs = make_job(s, owner="bob", priority=-5, age_s=500)
    running(s, bobs, started_ago_s=400)
    alices = make_job(s, owner="alice", priority=0, age_s=100)
    s.commit()
    assert run_pass(s, preempt_after_s=0) == []
    assert _preempted(s) == {}
    assert "preempt" not in reason(s, alices)


def test_a_stored_high_priority_job_does_not_preempt_a_user_protected_up_to_it(
    session: Session,
) -> None:
    """A priority 1000 job (as any non-admin could submit before) takes nothing from a
    user whose max_priority is at least its priority, even a job of theirs at -1000."""
    s = session
    make_worker(s, "w1")
    make_user(s, "bob").max_priority = 1000
    bobs = make_job(s, owner="bob", priority=-1000, age_s=500)
    running(s, bobs, started_ago_s=400)
    make_job(s, owner="alice", priority=1000, age_s=100)
    s.commit()
    assert run_pass(s, preempt_after_s=0) == []
    assert _preempted(s) == {}


def test_own_jobs_are_ordered_and_a_raised_user_preempts_only_below_them(
    session: Session,
) -> None:
    s = session
    make_worker(s, "w1")
    make_worker(s, "w2")
    make_user(s, "carol").max_priority = 10
    make_user(s, "dave").max_priority = 20
    bob_low = make_job(s, owner="bob", priority=-5, age_s=600)
    running(s, bob_low, started_ago_s=500)
    dave_low = make_job(s, owner="dave", priority=0, age_s=590)
    running(s, dave_low, started_ago_s=490)
    # bob's own urgent job takes his own low one, never dave's
    bob_now = make_job(s, owner="bob", priority=0, age_s=100)
    s.commit()
    assert run_pass(s, preempt_after_s=0) == []
    assert _preempted(s) == {bob_low.id: bob_now.id}
    # carol (max 10) at 10: above bob's limit (0), not dave's (20): she may take nothing
    # of dave's even though his job runs at 0
    carol = make_job(s, owner="carol", priority=10, age_s=50)
    s.commit()
    run_pass(s, preempt_after_s=0)
    assert _preempted(s) == {bob_low.id: bob_now.id}
    assert "preempt" not in reason(s, carol)


def _gang(job: str, owner: int, priority: int, owner_max: int) -> RunningGang:
    started = datetime.fromtimestamp(100).astimezone()
    return RunningGang(job, 1, owner, priority, started, "cpu", None, 1, owner_max)


@pytest.mark.parametrize(
    ("waiting", "gang", "taken"),
    [
        ((1, 0), (2, -5, 0), False),  # another user's default limit protects up to 0
        ((1, 1000), (2, -1000, 1000), False),  # protected up to their max_priority
        ((1, 1), (2, -5, 0), True),  # above the victim's owner's limit and priority
        ((1, 0), (1, -5, 0), True),  # one's own lower job
        ((1, 0), (1, 0, 0), False),  # never an equal priority, own or not
        ((1, 5), (2, 7, -10), False),  # never a higher priority
    ],
)
def test_the_rule_may_take(
    waiting: tuple[int, int], gang: tuple[int, int, int], taken: bool
) -> None:
    job = QueuedJob("w", 1, utcnow(), 1, None, *waiting)
    g = _gang("v", *gang)
    assert preemption.may_take(job, g) is taken
    got = preemption.choose([job], Pools([]), [g], {("cpu", ""): 1})
    assert [p.victim_job_id for p in got.preemptions] == (["v"] if taken else [])
