"""Projects in the scheduling pass (store/quotas.py: how a project's limits combine with its
users'): a project's max_workers holds every member's jobs, a user's still holds within an
unlimited project, the tighter of two is named; fair share in two levels (projects, then
users), with personal projects ordering exactly as per-user fair share. In-process against
SQLite and PostgreSQL (no broker, no trainer)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_user, make_worker

from torchyard.api.views import owner_reason
from torchyard.scheduler.cycle import PoolPolicy, queue_order, schedule
from torchyard.store.models import Attempt, Job, Project, utcnow
from torchyard.store.projects import ensure_personal
from torchyard.store.states import RUNNING, transition

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

TIMEOUT = 10.0
HOUR = 3600.0


def run_pass(s: Session) -> list[str]:
    out = schedule(s, heartbeat_timeout_s=TIMEOUT, pool=PoolPolicy(30.0, 86_400.0))
    s.commit()
    return [d.job_id for d in out]


def reason(s: Session, job: Job) -> str:
    s.refresh(job)
    return job.pending_reason or ""


def team(s: Session, name: str, **quota: float | int | None) -> Project:
    p = Project(name=name, created_at=utcnow(), **quota)
    s.add(p)
    s.flush()
    return p


def job_in(s: Session, project: Project | None, **kw: object) -> Job:
    """make_job's job in `project` (None: its owner's personal project)."""
    job = make_job(s, **kw)  # type: ignore[arg-type]
    owner = make_user(s, str(kw.get("owner", "alice")))
    job.project_id = project.id if project is not None else ensure_personal(s, owner).id
    s.flush()
    return job


def used(s: Session, project: Project | None, owner: str, hours: float) -> None:
    """A finished one-worker job of `owner` in `project` that ran for `hours`, just ended."""
    job = job_in(s, project, owner=owner, state="succeeded", age_s=hours * HOUR + 1)
    end = utcnow()
    start = end - timedelta(hours=hours)
    s.add(Attempt(job_id=job.id, number=1, state="succeeded", world_size=1,
                  created_at=start, started_at=start, ended_at=end))  # fmt: skip
    s.flush()


def running(s: Session, job: Job) -> None:
    """Start `job` (one pass) and mark its attempt and itself running."""
    assert job.id in run_pass(s)
    att = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    att.state, att.started_at = "running", utcnow() - timedelta(seconds=60)
    s.refresh(job)
    transition(s, job, RUNNING, reason="test")
    s.commit()


def workers(s: Session, n: int, first: int = 1) -> None:
    for i in range(first, first + n):
        make_worker(s, f"w{i}")
    s.commit()


# -- max_workers ----------------------------------------------------------------------------------


def test_a_projects_max_workers_holds_another_members_job_and_names_the_project(
    session: Session,
) -> None:
    s = session
    lab = team(s, "lab", max_workers=1)
    workers(s, 1)
    first = job_in(s, lab, owner="alice", age_s=100)
    running(s, first)
    second = job_in(s, lab, owner="bob", age_s=90)
    carol = job_in(s, None, owner="carol", age_s=1)
    workers(s, 2, first=2)
    assert run_pass(s) == [carol.id]  # bob's waits though bob holds nothing
    why = reason(s, second)
    assert why == "quota: project lab's jobs hold 1 of max_workers 1, this one needs 1"
    assert "alice" not in why and first.id not in why  # nothing of the other member's
    assert owner_reason(why, second.id, "bob") == why


def test_a_users_limit_still_holds_within_an_unlimited_project(session: Session) -> None:
    s = session
    lab = team(s, "lab")
    make_user(s, "alice").max_workers = 1
    workers(s, 1)
    running(s, job_in(s, lab, owner="alice", age_s=100))
    second = job_in(s, lab, owner="alice", age_s=90)
    bob = job_in(s, lab, owner="bob", age_s=1)
    workers(s, 2, first=2)
    assert run_pass(s) == [bob.id]
    assert reason(s, second) == "quota: alice's jobs hold 1 of max_workers 1, this one needs 1"


def test_a_pass_counts_what_it_gives_a_project(session: Session) -> None:
    s = session
    lab = team(s, "lab", max_workers=2)
    jobs = [job_in(s, lab, owner=o, age_s=100 - i) for i, o in enumerate(("a", "b", "c"))]
    workers(s, 3)
    assert run_pass(s) == [jobs[0].id, jobs[1].id]
    assert (
        reason(s, jobs[2]) == "quota: project lab's jobs hold 2 of max_workers 2, this one needs 1"
    )


def test_with_both_limits_full_the_tighter_is_named(session: Session) -> None:
    s = session
    lab = team(s, "lab", max_workers=3)
    alice = make_user(s, "alice")
    alice.max_workers = 2
    workers(s, 2)
    running(s, job_in(s, lab, owner="alice", world_size=2, age_s=100))
    workers(s, 3, first=3)
    two = job_in(s, lab, owner="alice", world_size=2, age_s=50)
    # alice: 2 of 2 held (no room), lab: 2 of 3 (room for 1): alice's own limit is named
    assert run_pass(s) == []
    assert reason(s, two) == "quota: alice's jobs hold 2 of max_workers 2, this one needs 2"
    # alice: room for 1, lab: none left: the project's is named
    alice.max_workers, lab.max_workers = 3, 2
    s.commit()
    assert run_pass(s) == []
    assert reason(s, two) == "quota: project lab's jobs hold 2 of max_workers 2, this one needs 2"
    # one it can never fit under is named first, whatever the room of the other
    alice.max_workers, lab.max_workers = 2, 1
    s.commit()
    assert run_pass(s) == []
    assert reason(s, two) == (
        "quota: needs 2 workers but project lab's max_workers is 1; "
        "it cannot start unless an admin raises the quota"
    )
    alice.max_workers, lab.max_workers = None, None
    s.commit()
    assert run_pass(s) == [two.id, two.id]  # one dispatch per rank


def test_a_personal_projects_limit_holds_its_users_personal_jobs_only(session: Session) -> None:
    s = session
    lab = team(s, "lab")
    ensure_personal(s, make_user(s, "alice")).max_workers = 1
    workers(s, 1)
    running(s, job_in(s, None, owner="alice", age_s=100))
    mine = job_in(s, None, owner="alice", age_s=90)
    teams = job_in(s, lab, owner="alice", age_s=80)
    workers(s, 2, first=2)
    assert run_pass(s) == [teams.id]
    assert (
        reason(s, mine) == "quota: project ~alice's jobs hold 1 of max_workers 1, this one needs 1"
    )


# -- two-level fair share -------------------------------------------------------------------------


def test_equal_usage_the_project_with_the_larger_share_goes_first(session: Session) -> None:
    s = session
    lab, vision = team(s, "lab", share=2.0), team(s, "vision")
    used(s, lab, "alice", 2.0)
    used(s, vision, "bob", 2.0)
    older = job_in(s, vision, owner="bob", age_s=100)
    newer = job_in(s, lab, owner="alice", age_s=10)
    workers(s, 1)
    assert run_pass(s) == [newer.id]  # 2 h / 2 < 2 h / 1, though bob's job is older
    why = reason(s, older)
    assert why.startswith(
        "fair share: project vision has used 1.9 CPU slot-h (share 1), project lab 1.9 (share 2) "
        "(half-life 1 day); "
    ), why
    seen = owner_reason(why, older.id, "bob")  # what vision's members read: not lab
    assert seen is not None and "lab" not in seen
    assert seen.startswith(
        "fair share: project vision has used 1.9 CPU slot-h (share 1); projects and users who "
        "used less go first (half-life 1 day); "
    ), seen


def test_a_busy_project_goes_after_a_lone_user_who_used_more_than_each_member(
    session: Session,
) -> None:
    s = session
    lab = team(s, "lab")
    for member in ("alice", "bob", "carol"):
        used(s, lab, member, 1.0)  # 3 h for lab, 1 h each
    used(s, None, "dave", 2.0)
    mine = job_in(s, lab, owner="alice", age_s=100)
    dave = job_in(s, None, owner="dave", age_s=10)
    workers(s, 1)
    # per user alice (1 h) would go before dave (2 h); per project lab (3 h) goes after
    assert run_pass(s) == [dave.id]
    why = reason(s, mine)
    assert why.startswith("fair share: project lab has used 3.0 CPU slot-h, dave 1.9 ("), why
    seen = owner_reason(why, mine.id, "alice")
    assert seen is not None and "dave" not in seen and "1.9" not in seen
    entries, _ = queue_order(s, 86_400.0, TIMEOUT)
    assert [e.job.id for e in entries] == [mine.id]  # dave's started


def test_within_a_project_the_member_who_used_less_goes_first(session: Session) -> None:
    s = session
    lab = team(s, "lab")
    used(s, lab, "alice", 2.0)
    used(s, None, "bob", 0.5)  # a user's usage counts in every project
    a = job_in(s, lab, owner="alice", age_s=100)
    b = job_in(s, lab, owner="bob", age_s=10)
    workers(s, 1)
    assert run_pass(s) == [b.id]
    assert reason(s, a).startswith("fair share: alice has used 1.9 CPU slot-h, bob 0.5 (")


def test_personal_projects_order_as_per_user_fair_share(session: Session) -> None:
    s = session
    used(s, None, "alice", 3.0)
    used(s, None, "bob", 0.5)
    a1 = job_in(s, None, owner="alice", age_s=100)
    b1 = job_in(s, None, owner="bob", age_s=10)
    workers(s, 1)
    assert run_pass(s) == [b1.id]
    # tests/scheduler/test_pool_scheduling.py's wording, jobs without a project or not
    assert reason(s, a1).startswith("fair share: alice has used 2.9 CPU slot-h, bob 0.5 (")


def test_the_queue_lists_jobs_in_the_two_level_order(session: Session) -> None:
    s = session
    lab = team(s, "lab", share=4.0)
    used(s, lab, "alice", 4.0)
    used(s, None, "bob", 2.0)
    bob = job_in(s, None, owner="bob", age_s=100)
    alice = job_in(s, lab, owner="alice", age_s=10)
    s.commit()
    entries, fs = queue_order(s, 86_400.0, TIMEOUT)
    assert [e.job.id for e in entries] == [alice.id, bob.id]  # 4 h / 4 < 2 h / 1
    assert fs.projects[lab.id].name == "lab"
