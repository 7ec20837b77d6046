"""What fair share, quotas and preemption read and write in a scheduling pass: each
user's and each project's limits and the workers their jobs hold (with, for the projects
routes, each project's running and queued jobs), the running gangs a waiting job could
preempt (with their owners' max_priority), the preemptions in flight, and the write that
asks a gang to stop.

Preemption is an intent in the store, like a cancel: the scheduler sets
`attempts.preempted_by` on the victim's running attempt (conditionally: still running,
not already preempted) and records a `preempted` event; the victim's supervisors see it
within a poll, SIGTERM their trainers (which checkpoint and exit 75) and hand the job back
to the queue (store/lifecycle.py), not counted against max_restarts.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from torchyard.store.jobs import bump_version
from torchyard.store.models import Attempt, Job, JobEvent, Project, User, Worker, utcnow
from torchyard.store.quotas import DEFAULT_MAX_PRIORITY
from torchyard.store.states import A_RUNNING, ACTIVE, ATTEMPT_ACTIVE, QUEUED, RUNNING
from torchyard.store.workers import BUSY


class PoolUser(NamedTuple):
    id: int
    name: str
    share: float
    max_workers: int | None


class PoolProject(NamedTuple):
    id: int
    name: str
    share: float
    max_workers: int | None
    personal_of: int | None  # the user whose personal project it is; None: a team's


class RunningGang(NamedTuple):
    """A running job a higher-priority one could preempt (one row per worker kind), with
    its owner's max_priority: another user's job must be above it to take this one."""

    job_id: str
    attempt_id: int
    owner_id: int
    priority: int
    started_at: datetime | None
    device: str
    device_name: str | None
    workers: int
    owner_max_priority: int = DEFAULT_MAX_PRIORITY


class Preemption(NamedTuple):
    victim_job_id: str
    attempt_id: int
    by_job_id: str


def pool_users(session: Session, user_ids: set[int]) -> dict[int, PoolUser]:
    if not user_ids:
        return {}
    rows = session.execute(
        select(User.id, User.name, User.share, User.max_workers).where(User.id.in_(user_ids))
    )
    return {r.id: PoolUser(r.id, r.name, float(r.share), r.max_workers) for r in rows}


def held_by_owner(session: Session) -> dict[int, int]:
    """Workers busy with each user's jobs (starting, running or stopping)."""
    rows = session.execute(
        select(Job.owner_id, func.count())
        .select_from(Worker)
        .join(Job, Job.id == Worker.current_job_id)
        .where(Worker.state == BUSY)
        .group_by(Job.owner_id)
    )
    return {int(uid): int(n) for uid, n in rows}


def pool_projects(session: Session, project_ids: set[int]) -> dict[int, PoolProject]:
    if not project_ids:
        return {}
    cols = (Project.id, Project.name, Project.share, Project.max_workers, Project.personal_of)
    rows = session.execute(select(*cols).where(Project.id.in_(project_ids)))
    return {
        r.id: PoolProject(r.id, r.name, float(r.share), r.max_workers, r.personal_of) for r in rows
    }


def held_by_project(session: Session, project_ids: set[int]) -> dict[int, int]:
    """Workers busy with each of these projects' jobs, whoever submitted them."""
    if not project_ids:
        return {}
    rows = session.execute(
        select(Job.project_id, func.count())
        .select_from(Worker)
        .join(Job, Job.id == Worker.current_job_id)
        .where(Worker.state == BUSY, Job.project_id.in_(project_ids))
        .group_by(Job.project_id)
    )
    return {int(pid): int(n) for pid, n in rows if pid is not None}


class ProjectLoad(NamedTuple):
    """What a project's jobs hold and wait for now (the projects pages' usage)."""

    running: int  # jobs starting, running or cancelling
    queued: int
    workers: int  # workers busy with its jobs, whoever submitted them


def project_loads(session: Session, project_ids: set[int]) -> dict[int, ProjectLoad]:
    """Each of these projects' active and queued jobs and the workers they hold: one
    grouped count on the jobs' project and state, and `held_by_project`."""
    if not project_ids:
        return {}
    counts: dict[int, dict[str, int]] = {pid: {} for pid in project_ids}
    rows = session.execute(
        select(Job.project_id, Job.state, func.count())
        .where(Job.project_id.in_(project_ids), Job.state.in_([QUEUED, *ACTIVE]))
        .group_by(Job.project_id, Job.state)
    )
    for pid, state, n in rows:
        if pid is not None:  # in_() keeps none; the column is nullable
            counts[pid][state] = int(n)
    held = held_by_project(session, project_ids)
    return {
        pid: ProjectLoad(
            running=sum(n for s, n in by.items() if s in ACTIVE),
            queued=by.get(QUEUED, 0),
            workers=held.get(pid, 0),
        )
        for pid, by in counts.items()
    }


def lowest_preemptible_priority(session: Session) -> int | None:
    """The lowest priority of a running preemptible job (a cheap probe on the state
    index, so a pass reads the running gangs only when a waiting job could preempt)."""
    return session.scalar(
        select(func.min(Job.priority)).where(Job.state == RUNNING, Job.preemptible.is_(True))
    )


def running_gangs(session: Session, below_priority: int) -> list[RunningGang]:
    """Running, preemptible jobs under `below_priority` whose running attempt is not being
    preempted already, with the kind and number of workers each holds and their owner's
    max_priority (the default where none is set)."""
    gang = (
        Job.id,
        Attempt.id,
        Job.owner_id,
        Job.priority,
        Attempt.started_at,
        Worker.device,
        Worker.device_name,
    )
    protected = func.coalesce(User.max_priority, DEFAULT_MAX_PRIORITY)
    q = (
        select(*gang, func.count(Worker.id), protected)
        .select_from(Worker)
        .join(Job, Job.id == Worker.current_job_id)
        .join(User, User.id == Job.owner_id)
        .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt))
        .where(
            Worker.state == BUSY,
            Job.state == RUNNING,
            Job.preemptible.is_(True),
            Job.priority < below_priority,
            Attempt.state == A_RUNNING,
            Attempt.preempted_by.is_(None),
        )
        .group_by(*gang, protected)
    )
    return [RunningGang(*row) for row in session.execute(q)]


def preemptions_in_flight(session: Session) -> dict[str, list[str]]:
    """Queued job -> the jobs still stopping for it (their attempts are still active)."""
    rows = session.execute(
        select(Attempt.preempted_by, Attempt.job_id).where(
            Attempt.preempted_by.is_not(None), Attempt.state.in_(ATTEMPT_ACTIVE)
        )
    )
    out: dict[str, list[str]] = {}
    for by, victim in rows:
        if by is not None:  # the query's own filter: typed as optional, never null here
            out.setdefault(by, []).append(victim)
    return out


def preempt(session: Session, preemptions: list[Preemption]) -> list[Preemption]:
    """Ask each victim's running attempt to stop for its preemptor; returns those asked
    (an attempt that ended or was preempted meanwhile is left alone)."""
    done = []
    now = utcnow()
    for p in preemptions:
        res = session.execute(
            update(Attempt)
            .where(
                Attempt.id == p.attempt_id,
                Attempt.state == A_RUNNING,
                Attempt.preempted_by.is_(None),
            )
            .values(preempted_by=p.by_job_id)
            .execution_options(synchronize_session=False)
        )
        if res.rowcount != 1:  # type: ignore[attr-defined]
            continue
        number = session.scalar(select(Attempt.number).where(Attempt.id == p.attempt_id))
        session.execute(
            insert(JobEvent).values(
                job_id=p.victim_job_id,
                type="preempted",
                data={"by": p.by_job_id, "attempt": number},
                created_at=now,
            )
        )
        bump_version(session, p.victim_job_id)
        done.append(p)
    return done
