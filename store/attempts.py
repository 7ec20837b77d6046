"""Attempts and their assignments: creation (scheduler), the lease a worker takes on its
assignment, the rendezvous endpoint, and the one function that ends an attempt and moves
its job on (succeeded, failed, cancelled, or back to queued for a retry).

An attempt ends exactly once: `finish_attempt` is a conditional update on the attempt's
state, so when several parties race to end it (each rank's worker, the reaper) the first
decides and the others get None.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from store.models import Assignment, Attempt, Checkpoint, Job, Worker, utcnow
from store.paths import UnsafePath, resolve_inside
from store.states import (
    CANCELLED,
    CANCELLING,
    FAILED,
    QUEUED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    IllegalTransition,
    transition,
)

# Attempt states.
A_STARTING, A_RUNNING = "starting", "running"
A_SUCCEEDED, A_FAILED, A_LOST = "succeeded", "failed", "lost"
A_HANDED_BACK, A_CANCELLED = "handed_back", "cancelled"
ATTEMPT_ACTIVE = (A_STARTING, A_RUNNING)
# Attempts that count against a job's max_restarts (a hand-back by a stopping worker does not).
ATTEMPT_COUNTED = (A_FAILED, A_LOST)


def create_attempt(session: Session, job: Job, workers: list[Worker]) -> Attempt:
    """Record attempt `job.attempt` with one assignment per rank (rank i -> workers[i])."""
    attempt = Attempt(job_id=job.id, number=job.attempt, world_size=len(workers), state=A_STARTING)
    session.add(attempt)
    session.flush()
    for rank, w in enumerate(workers):
        session.add(Assignment(attempt_id=attempt.id, job_id=job.id, rank=rank, worker_id=w.id))
    session.flush()
    return attempt


def assignments_of(session: Session, attempt_id: int) -> list[Assignment]:
    return list(
        session.scalars(
            select(Assignment).where(Assignment.attempt_id == attempt_id).order_by(Assignment.rank)
        )
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


def set_endpoint(session: Session, attempt_id: int, endpoint: str) -> None:
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id)
        .values(rank0_endpoint=endpoint)
        .execution_options(synchronize_session=False)
    )


def read_endpoint(session: Session, attempt_id: int) -> tuple[str | None, str | None]:
    """(rank 0's endpoint or None, the attempt's state)."""
    row = session.execute(
        select(Attempt.rank0_endpoint, Attempt.state).where(Attempt.id == attempt_id)
    ).first()
    return (row[0], row[1]) if row else (None, None)


def attempt_state(session: Session, attempt_id: int) -> str | None:
    return session.scalar(select(Attempt.state).where(Attempt.id == attempt_id))


def mark_attempt_running(session: Session, attempt_id: int) -> None:
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.state == A_STARTING)
        .values(state=A_RUNNING)
        .execution_options(synchronize_session=False)
    )


def end_assignment(session: Session, assignment_id: int, exit_code: int | None) -> None:
    session.execute(
        update(Assignment)
        .where(Assignment.id == assignment_id, Assignment.ended_at.is_(None))
        .values(ended_at=utcnow(), exit_code=exit_code)
        .execution_options(synchronize_session=False)
    )


def counted_failures(session: Session, job_id: str) -> int:
    """Failed or lost attempts of a job: what max_restarts is compared with."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Attempt)
            .where(Attempt.job_id == job_id, Attempt.state.in_(ATTEMPT_COUNTED))
        )
        or 0
    )


def finish_attempt(
    session: Session,
    attempt_id: int,
    outcome: str,
    *,
    exit_code: int | None = None,
    reason: str | None = None,
    error: str | None = None,
    retryable: bool = True,
) -> str | None:
    """End an active attempt with `outcome` (an attempt state) and move its job on.

    - succeeded -> job succeeded; cancelled, or any end while the job is cancelling ->
      job cancelled (succeeded still wins if the trainer finished first);
    - handed_back (a stopping worker) -> job queued with attempt + 1, not counted;
    - failed with retryable=False (a deterministic error) -> job failed with `error`;
    - lost, or failed with retryable=True -> job queued with attempt + 1 while the failed
      and lost attempts number at most max_restarts, else failed.
    Returns the job's state afterwards, or None if the attempt had already ended.
    """
    now = utcnow()
    res = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.state.in_(ATTEMPT_ACTIVE))
        .values(state=outcome, exit_code=exit_code, reason=reason, ended_at=now)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    assert attempt is not None
    # A message for a rank that never started must not start it now.
    session.execute(
        update(Assignment)
        .where(Assignment.attempt_id == attempt_id, Assignment.claimed_at.is_(None))
        .values(ended_at=now)
        .execution_options(synchronize_session=False)
    )
    job = session.get(Job, attempt.job_id, populate_existing=True)
    if job is None:
        return None
    if job.attempt != attempt.number or job.state not in (STARTING, RUNNING, CANCELLING):
        return job.state
    why = reason or outcome
    try:
        if job.state == CANCELLING:
            to = SUCCEEDED if outcome == A_SUCCEEDED else CANCELLED
            transition(session, job, to, reason=why)
        elif outcome == A_SUCCEEDED:
            transition(session, job, SUCCEEDED, reason=why)
        elif outcome == A_CANCELLED:
            # Only reachable for a job that is not cancelling: nothing asked for it.
            transition(session, job, FAILED, reason=why, error=error or why)
        elif outcome == A_HANDED_BACK:
            transition(
                session,
                job,
                QUEUED,
                reason=why,
                attempt=job.attempt + 1,
                pending_reason=f"handed back: {why}",
            )
        elif outcome == A_FAILED and not retryable:
            transition(session, job, FAILED, reason=why, error=error or why)
        else:
            n = counted_failures(session, job.id)
            if n <= job.max_restarts:
                transition(
                    session,
                    job,
                    QUEUED,
                    reason=why,
                    attempt=job.attempt + 1,
                    pending_reason=f"retrying after: {why}",
                )
            else:
                msg = error or why
                transition(
                    session,
                    job,
                    FAILED,
                    reason=why,
                    error=f"{msg} (gave up after {n} failed attempts, max_restarts={job.max_restarts})",
                )
    except IllegalTransition:
        # The API moved the job meanwhile (e.g. cancelled); its state stands.
        pass
    return job.state


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
    gone). Returns the ids of the jobs affected."""
    jobs = []
    for attempt_id, job_id in _open_assignments(session, worker_id):
        session.execute(
            update(Assignment)
            .where(Assignment.attempt_id == attempt_id, Assignment.worker_id == worker_id)
            .values(ended_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if finish_attempt(session, attempt_id, A_LOST, reason=reason) is not None:
            jobs.append(job_id)
    return jobs


def hand_back_unclaimed(session: Session, worker_id: str, reason: str) -> list[str]:
    """A stopping worker gives back assignments it was sent but never started."""
    jobs = []
    for attempt_id, job_id in _open_assignments(
        session, worker_id, Assignment.claimed_at.is_(None)
    ):
        if finish_attempt(session, attempt_id, A_HANDED_BACK, reason=reason) is not None:
            jobs.append(job_id)
    return jobs


def latest_resume_checkpoint(
    session: Session, job_id: str, run_dir: Path
) -> tuple[str, Path] | None:
    """The newest recorded resume checkpoint of a job whose file is still there (keep_last
    deletes old ones), as (path relative to the run dir, resolved path inside it)."""
    rows = session.execute(
        select(Checkpoint.path)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.kind == "resume",
            Checkpoint.deleted.is_(False),
        )
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
    ).all()
    for (rel,) in rows:
        try:
            path = resolve_inside(run_dir, rel)
        except UnsafePath:
            continue
        if path.is_file():
            return rel, path
    return None


def unclaimed_assignments(session: Session, older_than: datetime) -> list[tuple[int, str, str]]:
    """(assignment id, worker id, worker queue) for live attempts' ranks that no worker has
    claimed since `older_than`: their message may have been lost."""
    rows = session.execute(
        select(Assignment.id, Worker.id, Worker.queue)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .join(Worker, Worker.id == Assignment.worker_id)
        .where(
            Assignment.claimed_at.is_(None),
            Assignment.ended_at.is_(None),
            Assignment.created_at < older_than,
            Attempt.state.in_(ATTEMPT_ACTIVE),
        )
    ).all()
    return [(a, w, q) for a, w, q in rows]


def abandon_assignments_of_gone_workers(session: Session, older_than: datetime) -> list[str]:
    """Unclaimed ranks of live attempts whose worker stopped or was lost before it could
    start them (a stop racing an assignment): the attempt is handed back, not counted."""
    rows = session.execute(
        select(Assignment.attempt_id, Worker.id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .join(Worker, Worker.id == Assignment.worker_id)
        .where(
            Assignment.claimed_at.is_(None),
            Assignment.ended_at.is_(None),
            Assignment.created_at < older_than,
            Attempt.state.in_(ATTEMPT_ACTIVE),
            Worker.state.in_(("stopped", "lost")),
        )
    ).all()
    jobs = []
    for attempt_id, wid in rows:
        why = f"worker {wid} went away before starting its rank"
        state = finish_attempt(session, attempt_id, A_HANDED_BACK, reason=why)
        if state is not None:
            jobs.append(state)
    return jobs
