"""Attempts and their assignments: creation (scheduler), the lease a worker takes on its
assignment, the rendezvous endpoint, the ingest offset, and the bulk endings (a worker lost
or stopping). How an ending moves the job on is `store.lifecycle.finish_attempt`.

Writes a worker makes for its attempt (`mark_launched`, `set_endpoint`) are fenced:
refused with `Fenced` once the attempt has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from torchyard.storage import Storage
from torchyard.storage.keys import UnsafePath
from torchyard.store.dialect import is_postgres
from torchyard.store.jobs import bump_version_of_attempt, bump_version_sql
from torchyard.store.lifecycle import Fenced, counted_failures, fence, finish_attempt
from torchyard.store.models import Assignment, Attempt, Checkpoint, Job, Sweep, Worker, utcnow
from torchyard.store.states import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_RUNNING,
    A_STARTING,
    A_SUCCEEDED,
    ATTEMPT_ACTIVE,
    ATTEMPT_COUNTED,
    CANCELLING,
    W_LOST,
    W_STOPPED,
)

__all__ = [  # the attempt vocabulary callers import from here
    "ATTEMPT_ACTIVE",
    "ATTEMPT_COUNTED",
    "A_CANCELLED",
    "A_FAILED",
    "A_HANDED_BACK",
    "A_LOST",
    "A_RUNNING",
    "A_STARTING",
    "A_SUCCEEDED",
    "counted_failures",
    "finish_attempt",
]


@dataclass(frozen=True)
class Claimed:
    """What a worker needs to run the rank it just claimed."""

    assignment_id: int
    attempt_id: int
    attempt_number: int
    job_id: str
    rank: int
    world_size: int
    spec: dict[str, Any]
    cancelling: bool
    # a sweep trial's objective and its sweep's pruner (None: not a trial)
    sweep_metric: str | None = None
    sweep_pruner: str | None = None
    owner_id: int | None = None  # whose job: a warm trainer never serves two users


def claim_rank(session: Session, assignment_id: int, worker_id: str) -> Claimed | None:
    """`claim_assignment`, and what the worker needs to run the rank; None: start nothing."""
    a = claim_assignment(session, assignment_id, worker_id)
    if a is None:
        return None
    row = session.execute(
        select(
            Attempt.number,
            Attempt.world_size,
            Job.spec,
            Job.state,
            Job.cancel_requested,
            Sweep.metric,
            Sweep.pruner,
            Job.owner_id,
        )
        .join(Job, Job.id == Attempt.job_id)
        .outerjoin(Sweep, Sweep.id == Job.sweep_id)
        .where(Attempt.id == a.attempt_id)
    ).one()
    number, world_size, spec, job_state, cancel_requested, metric, pruner, owner_id = row
    return Claimed(
        assignment_id=a.id,
        attempt_id=a.attempt_id,
        attempt_number=number,
        job_id=a.job_id,
        rank=a.rank,
        world_size=world_size,
        spec=dict(spec),
        cancelling=job_state == CANCELLING or bool(cancel_requested),
        sweep_metric=metric,
        sweep_pruner=pruner,
        owner_id=owner_id,
    )


def claim_assignment(session: Session, assignment_id: int, worker_id: str) -> Assignment | None:
    """Take the lease on an assignment. None when it is not this worker's, already claimed
    (a duplicate delivery), ended, or its attempt is over: then nothing must be started."""
    active = select(Attempt.id).where(Attempt.state.in_(ATTEMPT_ACTIVE))
    res = session.execute(
        update(Assignment)
        .where(
            Assignment.id == assignment_id,
            Assignment.worker_id == worker_id,
            Assignment.claimed_at.is_(None),
            Assignment.ended_at.is_(None),
            Assignment.attempt_id.in_(active),
        )
        .values(claimed_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.get(Assignment, assignment_id, populate_existing=True)


def mark_launched(
    session: Session, assignment_id: int, pid: int, *, resumed_from: str | None
) -> None:
    """The trainer process exists: record its pid and when the attempt started."""
    a = session.get(Assignment, assignment_id)
    if a is None:
        return
    fence(session, a.attempt_id)
    a.pid = pid
    now = utcnow()
    values: dict[str, object] = {"started_at": func.coalesce(Attempt.started_at, now)}
    if a.rank == 0:
        values["resumed_from"] = resumed_from
    session.execute(
        update(Attempt)
        .where(Attempt.id == a.attempt_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    bump_version_of_attempt(session, a.attempt_id)


def set_endpoint(
    session: Session, attempt_id: int, endpoint: str, *, resumed_from: str | None
) -> None:
    """Rank 0's rendezvous endpoint and the checkpoint it resumes from, in one write: the
    other ranks resume from exactly that one (their own look-up could run before rank 0
    recorded an earlier attempt's last checkpoint, and start a step apart)."""
    fence(session, attempt_id)
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id)
        .values(rank0_endpoint=endpoint, resumed_from=resumed_from)
        .execution_options(synchronize_session=False)
    )
    bump_version_of_attempt(session, attempt_id)


class Endpoint(NamedTuple):
    """What a rank other than 0 reads while it waits for rank 0."""

    endpoint: str | None  # rank 0's host:port; None until published
    state: str | None  # the attempt's state; None when the attempt is gone
    resumed_from: str | None  # the checkpoint every rank resumes from (None: fresh start)


def read_endpoint(session: Session, attempt_id: int) -> Endpoint:
    row = session.execute(
        select(Attempt.rank0_endpoint, Attempt.state, Attempt.resumed_from).where(
            Attempt.id == attempt_id
        )
    ).first()
    return Endpoint(*row) if row else Endpoint(None, None, None)


def attempt_hosts(session: Session, attempt_id: int) -> list[str]:
    """The distinct hosts of the workers that run the attempt's ranks."""
    rows = session.scalars(
        select(Worker.host)
        .join(Assignment, Assignment.worker_id == Worker.id)
        .where(Assignment.attempt_id == attempt_id)
        .distinct()
    )
    return sorted(rows)


class AttemptStatus(NamedTuple):
    """What a supervisor polls: the job's state, the attempt's, and the job the attempt is
    being preempted for (None: not preempted). All None when the attempt is gone."""

    job: str | None
    attempt: str | None
    preempted_by: str | None = None


def attempt_status(session: Session, attempt_id: int) -> AttemptStatus:
    row = session.execute(
        select(Job.state, Attempt.state, Attempt.preempted_by)
        .join(Attempt, Attempt.job_id == Job.id)
        .where(Attempt.id == attempt_id)
    ).first()
    return AttemptStatus(*row) if row else AttemptStatus(None, None)


def job_and_attempt_state(session: Session, attempt_id: int) -> tuple[str | None, str | None]:
    """(the job's state, the attempt's state); (None, None) when the attempt is gone."""
    st = attempt_status(session, attempt_id)
    return st.job, st.attempt


def ingest_start(session: Session, job_id: str) -> int:
    """Where in the job's events.jsonl the store's record ends: the furthest any attempt's
    supervisor committed. Events past it (a trainer's last lines before its worker lost
    the store, or died) are ingested by whoever supervises the job next."""
    return int(
        session.scalar(
            select(func.coalesce(func.max(Attempt.events_offset), 0)).where(
                Attempt.job_id == job_id
            )
        )
        or 0
    )


# `fence` as an UPDATE: it locks the attempt's row as `fence` does (an ending elsewhere, an
# UPDATE of that row, waits for this transaction's commit, or has committed and this
# UPDATE, re-checking the state, matches nothing) and moves the events offset up to
# :offset (NULL: leaves it). The states are store/states.py's constants.
_FENCE_SQL = f"""
UPDATE attempts
SET events_offset = CASE WHEN events_offset < :offset THEN :offset ELSE events_offset END
WHERE id = :attempt AND state IN ({", ".join(f"'{s}'" for s in ATTEMPT_ACTIVE)})
RETURNING job_id
"""


def fence_flush(
    session: Session,
    attempt_id: int,
    offset: int | None,
    *,
    touch_job: bool,
    progress: tuple[int, dict[str, Any]] | None = None,
) -> str:
    """A worker's flush, first: `fence` the attempt (Fenced if it has ended), move its
    events offset up to `offset`, and with `touch_job` bump its job's version, writing
    `progress` too (store.jobs.bump_version_sql). Returns the job's id.

    One round trip on PostgreSQL: the attempt's UPDATE in a CTE whose job id the job's
    UPDATE reads, so rows are locked as in `finish_attempt`: attempt, then job. SQLite (no
    UPDATE in a CTE) runs two statements; BEGIN IMMEDIATE serialises its writers."""
    params = {"attempt": attempt_id, "offset": offset}
    postgres = is_postgres(session)
    if touch_job and postgres:
        bump, binds = bump_version_sql("(SELECT job_id FROM fenced)", progress, postgres=True)
        sql = text(f"WITH fenced AS ({_FENCE_SQL}) {bump} RETURNING id").bindparams(*binds)
        job_id = session.scalar(sql, params)
    else:
        job_id = session.scalar(text(_FENCE_SQL), params)
        if job_id is not None and touch_job:
            bump, binds = bump_version_sql(":job", progress, postgres=False)
            session.execute(text(bump).bindparams(*binds), {"job": job_id})
    if job_id is None:
        state = session.scalar(select(Attempt.state).where(Attempt.id == attempt_id))
        raise Fenced(attempt_id, state)
    return str(job_id)


def note_attempt(session: Session, attempt_id: int, note: str | None) -> None:
    """An active attempt's reason while it runs (what its worker set aside so far: GET
    /v1/jobs/{id} shows it with the attempt); its end writes the final reason. In a flush,
    after `fence_flush` (which bumps the job's version)."""
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.state.in_(ATTEMPT_ACTIVE))
        .values(reason=note)
        .execution_options(synchronize_session=False)
    )


def end_assignment(session: Session, assignment_id: int, exit_code: int | None) -> None:
    session.execute(
        update(Assignment)
        .where(Assignment.id == assignment_id, Assignment.ended_at.is_(None))
        .values(ended_at=utcnow(), exit_code=exit_code)
        .execution_options(synchronize_session=False)
    )


def _open_assignments(session: Session, worker_id: str, *where: Any) -> list[tuple[int, str]]:
    """(attempt id, job id) of the worker's assignments not yet ended, in active attempts."""
    rows = session.execute(
        select(Assignment.attempt_id, Assignment.job_id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .where(
            Assignment.worker_id == worker_id,
            Assignment.ended_at.is_(None),
            Attempt.state.in_(ATTEMPT_ACTIVE),
            *where,
        )
    ).all()
    return [(a, j) for a, j in rows]


def lose_worker_assignments(session: Session, worker_id: str, reason: str) -> list[str]:
    """End, as lost, every active attempt that has a rank on `worker_id` (whose process is
    gone), or handed back if it was being preempted (lose_attempt). Returns the ids of the
    jobs affected."""
    jobs = []
    for attempt_id, job_id in _open_assignments(session, worker_id):
        session.execute(
            update(Assignment)
            .where(Assignment.attempt_id == attempt_id, Assignment.worker_id == worker_id)
            .values(ended_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if lose_attempt(session, attempt_id, reason) is not None:
            jobs.append(job_id)
    return jobs


def lose_attempt(session: Session, attempt_id: int, reason: str) -> str | None:
    """End an attempt nobody supervises any more: lost (counted against max_restarts), or
    handed back if the scheduler was preempting it, since the pool asked it to stop and its
    worker dying on the way is not the job's fault. Returns finish_attempt's answer."""
    by = session.scalar(select(Attempt.preempted_by).where(Attempt.id == attempt_id))
    if by is None:
        return finish_attempt(session, attempt_id, A_LOST, reason=reason)
    why = f"{reason} while preempted by job {by}"
    return finish_attempt(session, attempt_id, A_HANDED_BACK, reason=why)


def hand_back_unclaimed(session: Session, worker_id: str, reason: str) -> list[str]:
    """A stopping worker gives back assignments it was sent but never started."""
    jobs = []
    for attempt_id, job_id in _open_assignments(
        session, worker_id, Assignment.claimed_at.is_(None)
    ):
        if finish_attempt(session, attempt_id, A_HANDED_BACK, reason=reason) is not None:
            jobs.append(job_id)
    return jobs


def _resume_candidates(session: Session, job_id: str) -> list[tuple[str, str]]:
    """A job's recorded resume checkpoints (not deleted), newest first, as (path relative
    to its run directory, sha256)."""
    rows = session.execute(
        select(Checkpoint.path, Checkpoint.sha256)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.kind == "resume",
            Checkpoint.deleted.is_(False),
        )
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
    ).all()
    return [(rel, sha) for rel, sha in rows]


def resume_pick(session: Session, job_id: str, storage: Storage) -> str | None:
    """The newest recorded resume checkpoint of a job whose file is still in storage
    (keep_last deletes old ones), relative to the run directory; None: a fresh start."""
    for rel, sha in _resume_candidates(session, job_id):
        try:
            if storage.find_recorded_file(job_id, rel, sha) is not None:
                return rel
        except UnsafePath:
            continue
    return None


def unclaimed_since(older_than: datetime) -> tuple[Any, ...]:
    """Where-clauses: ranks of live attempts that no worker claimed since `older_than`
    (the query must join Attempt)."""
    return (
        Assignment.claimed_at.is_(None),
        Assignment.ended_at.is_(None),
        Assignment.created_at < older_than,
        Attempt.state.in_(ATTEMPT_ACTIVE),
    )


def unclaimed_assignments(session: Session, older_than: datetime) -> list[tuple[int, str, str]]:
    """(assignment id, worker id, worker queue) for live attempts' ranks that no worker has
    claimed since `older_than`: their message may have been lost."""
    rows = session.execute(
        select(Assignment.id, Worker.id, Worker.queue)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .join(Worker, Worker.id == Assignment.worker_id)
        .where(
            *unclaimed_since(older_than),
        )
    ).all()
    return [(a, w, q) for a, w, q in rows]


def abandon_assignments_of_gone_workers(session: Session, older_than: datetime) -> list[str]:
    """Unclaimed ranks of live attempts whose worker stopped or was lost before it could
    start them (a stop racing an assignment): the attempt is handed back, not counted."""
    rows = session.execute(
        select(Assignment.attempt_id, Assignment.job_id, Worker.id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .join(Worker, Worker.id == Assignment.worker_id)
        .where(
            *unclaimed_since(older_than),
            Worker.state.in_((W_STOPPED, W_LOST)),
        )
    ).all()
    jobs = []
    for attempt_id, job_id, wid in rows:
        why = f"worker {wid} went away before starting its rank"
        if finish_attempt(session, attempt_id, A_HANDED_BACK, reason=why) is not None:
            jobs.append(job_id)
    return jobs
