"""The job state machine. Every change of a job's state goes through `transition`."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from torchyard.store.models import Job, JobEvent, utcnow

QUEUED, STARTING, RUNNING = "queued", "starting", "running"
SUCCEEDED, FAILED, CANCELLING, CANCELLED = "succeeded", "failed", "cancelling", "cancelled"
STATES = (QUEUED, STARTING, RUNNING, SUCCEEDED, FAILED, CANCELLING, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({STARTING, RUNNING, CANCELLING})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({STARTING, CANCELLED, FAILED}),
    # back to queued: a lost or handed-back attempt, retried with attempt + 1
    STARTING: frozenset({RUNNING, QUEUED, FAILED, CANCELLING, CANCELLED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, QUEUED, CANCELLING}),
    # the trainer may finish or fail before the cancel reaches it
    CANCELLING: frozenset({CANCELLED, SUCCEEDED, FAILED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


# Attempt states (one try at running a job).
A_STARTING, A_RUNNING = "starting", "running"
A_SUCCEEDED, A_FAILED, A_LOST = "succeeded", "failed", "lost"
A_HANDED_BACK, A_CANCELLED = "handed_back", "cancelled"
ATTEMPT_ACTIVE = (A_STARTING, A_RUNNING)
# Attempts that count against a job's max_restarts (a hand-back by a stopping worker does not).
ATTEMPT_COUNTED = (A_FAILED, A_LOST)


class IllegalTransition(Exception):
    """A state change the table forbids, or one that lost a race (the API answers 409)."""

    def __init__(self, job_id: str, from_state: str, to_state: str, why: str = ""):
        self.job_id, self.from_state, self.to_state = job_id, from_state, to_state
        super().__init__(why or f"job {job_id} cannot go from {from_state} to {to_state}")


def can_transition(from_state: str, to_state: str) -> bool:
    return to_state in TRANSITIONS.get(from_state, frozenset())


def transition(
    session: Session,
    job: Job,
    to_state: str,
    *,
    reason: str | None = None,
    error: str | None = None,
    **fields: Any,
) -> Job:
    """Move `job` to `to_state`, checking the table, and record a `state` job event.

    The update is conditional on the state the caller read, so two processes racing
    on one job cannot both succeed: the loser gets IllegalTransition. `fields` are
    other job columns set in the same update (attempt, pending_reason, …).
    """
    from_state = job.state
    if not can_transition(from_state, to_state):
        raise IllegalTransition(job.id, from_state, to_state)
    now = utcnow()
    values: dict[str, Any] = {"state": to_state, "updated_at": now, **fields}
    if error is not None:
        values["error"] = error
    if to_state == RUNNING and job.started_at is None:
        values["started_at"] = now
    if to_state in TERMINAL:
        values["finished_at"] = now
        values.setdefault("pending_reason", None)
    if to_state != QUEUED:
        values.setdefault("pending_reason", None)
    res = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == from_state)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        session.refresh(job)
        raise IllegalTransition(
            job.id, from_state, to_state, f"job {job.id} changed state concurrently"
        )
    for k, v in values.items():
        setattr(job, k, v)
    session.add(
        JobEvent(
            job_id=job.id,
            type="state",
            data={"from": from_state, "to": to_state, "reason": reason, "attempt": job.attempt},
            created_at=now,
        )
    )
    return job
