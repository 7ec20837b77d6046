"""The job state machine (every change of a job's state goes through `transition`, or
`transition_many` for a batch), and the names of attempt and worker states."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import JSON, String, cast, insert, literal, select, update
from sqlalchemy.orm import Session

from torchyard.contracts.states import (
    ATTEMPT_ACTIVE,
    ATTEMPT_COUNTED,
    JOB_ACTIVE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    WORKER_LIVE,
    AttemptState,
    JobState,
    WorkerState,
    can_transition,
)
from torchyard.store.dialect import in_list, is_postgres, unnest
from torchyard.store.models import Job, JobEvent, UTCDateTime, table_of, utcnow
from torchyard.store.webhooks import enqueue_job_events

# Short names for the store's queries (the tables are contracts/states.py's).
QUEUED, STARTING, RUNNING = JobState.QUEUED, JobState.STARTING, JobState.RUNNING
SUCCEEDED, FAILED = JobState.SUCCEEDED, JobState.FAILED
CANCELLING, CANCELLED = JobState.CANCELLING, JobState.CANCELLED
STATES = tuple(JobState)
TERMINAL, ACTIVE, TRANSITIONS = JOB_TERMINAL, JOB_ACTIVE, JOB_TRANSITIONS

W_IDLE, W_BUSY = WorkerState.IDLE, WorkerState.BUSY
W_LOST, W_STOPPED = WorkerState.LOST, WorkerState.STOPPED
W_LIVE = tuple(WORKER_LIVE)

A_STARTING, A_RUNNING = AttemptState.STARTING, AttemptState.RUNNING
A_SUCCEEDED, A_FAILED, A_LOST = AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.LOST
A_HANDED_BACK, A_CANCELLED = AttemptState.HANDED_BACK, AttemptState.CANCELLED
__all__ = ["ATTEMPT_ACTIVE", "ATTEMPT_COUNTED", "IllegalTransition", "can_transition"]


class IllegalTransition(Exception):
    """A state change the table forbids, or one that lost a race (the API answers 409)."""

    def __init__(self, job_id: str, from_state: str, to_state: str, why: str = ""):
        self.job_id, self.from_state, self.to_state = job_id, from_state, to_state
        super().__init__(why or f"job {job_id} cannot go from {from_state} to {to_state}")


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
    if to_state in TERMINAL:  # its webhooks' deliveries, in this transaction
        enqueue_job_events(session, [job.id], to_state, now)
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
    t = table_of(JobEvent)
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
    if to_state in TERMINAL:  # the jobs' webhooks' deliveries, in this transaction
        enqueue_job_events(session, [j for j, _, _ in jobs], to_state, now)
    return True
