"""The job state machine (every change of a job's state goes through `transition`, or
`transition_many` for a batch), and the names of attempt and worker states."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import JSON, String, cast, insert, literal, select, update
from sqlalchemy.orm import Session

from torchyard.store.dialect import in_list, is_postgres, unnest
from torchyard.store.models import Job, JobEvent, UTCDateTime, utcnow

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


# Worker states: idle (may be assigned), busy (holds an assignment), lost (heartbeat stale),
# stopped (deregistered, or stopping: no new work). store/workers.py re-exports them as
# IDLE, BUSY, LOST, STOPPED.
W_IDLE, W_BUSY, W_LOST, W_STOPPED = "idle", "busy", "lost", "stopped"
W_LIVE = (W_IDLE, W_BUSY)

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


def transition_many(
    session: Session, jobs: list[tuple[str, int, str]], from_state: str, to_state: str
) -> bool:
    """`transition` for many jobs in one statement: (job id, its attempt, reason) each, all
    moving from `from_state` to `to_state`, with their `state` job events. Conditional on
    every job still being in `from_state`: False (and the caller rolls back) when one
    changed concurrently."""
    if not can_transition(from_state, to_state):
        raise IllegalTransition(",".join(j for j, _, _ in jobs), from_state, to_state)
    if to_state == RUNNING:  # started_at is per job: `transition` sets it
        raise ValueError("transition_many does not move jobs to running")
    if not jobs:
        return True
    now = utcnow()
    values: dict[str, Any] = {"state": to_state, "updated_at": now}
    if to_state != QUEUED:
        values["pending_reason"] = None
    if to_state in TERMINAL:
        values["finished_at"] = now
    res = session.execute(
        update(Job)
        .where(in_list(session, Job.id, [j for j, _, _ in jobs]), Job.state == from_state)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != len(jobs):  # type: ignore[attr-defined]
        return False
    events = [
        (jid, {"from": from_state, "to": to_state, "reason": why, "attempt": attempt})
        for jid, attempt, why in jobs
    ]
    t = JobEvent.__table__
    if is_postgres(session):
        u = unnest(
            "u",
            job=([j for j, _ in events], String()),
            data=([json.dumps(d) for _, d in events], String()),
        )
        rows = select(u.c.job, literal("state"), cast(u.c.data, JSON), literal(now, UTCDateTime))
        session.execute(insert(t).from_select(["job_id", "type", "data", "created_at"], rows))
    else:
        session.execute(
            insert(t),
            [{"job_id": j, "type": "state", "data": d, "created_at": now} for j, d in events],
        )
    return True
