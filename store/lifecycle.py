"""The one place where an attempt's end moves its job on.

Every job state change goes through `store.states.transition` (the table); this module
holds the decisions that call it for a running job:
- `finish_attempt`: ends an attempt exactly once and moves its job to succeeded, failed,
  cancelled or back to queued for a retry;
- `mark_started`: the trainer's `started` event moves the job starting -> running;
- `fence`: the check every worker write for an attempt makes first. A worker whose
  attempt was ended by someone else (the reaper after a partition, a peer rank) has a
  stale token, and its writes are refused with `Fenced`, so a trainer that ran on
  after its attempt was given up can never change the record.

A sweep trial paused at a rung (`pruner: halving`, store/pruning.py) is handed back held:
queued with `hold_until` at PAUSED_HOLD, until the sweep's controller releases it (clears
the hold) or prunes it (cancels it). Such hand-backs are not failures of a host.

A job handed back again and again (not for a preemption) backs off: past HANDBACK_FREE
hand-backs in a row it is queued with `hold_until` (HANDBACK_FIRST_S, doubling, at most
HANDBACK_MAX_S), which a scheduling pass waits for (store/queue.py), and its pending
reason says so. A hand-back is not counted against max_restarts; the backoff keeps one
that repeats (a host that keeps failing the job) from spinning.

How a trainer process ended is classified into an attempt outcome by the worker
(`worker/outcome.py`); what that outcome does to the job is decided here.
No transition error is swallowed: each decision reads the job under a row lock, so a
refused transition is a bug and raises.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from torchyard.contracts.rungs import PAUSED_AT
from torchyard.store.dialect import db_now, is_postgres
from torchyard.store.jobs import bump_version_of_attempt
from torchyard.store.models import PAUSED_HOLD, Assignment, Attempt, Job, SweepTrial, utcnow
from torchyard.store.states import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_RUNNING,
    A_SUCCEEDED,
    ATTEMPT_ACTIVE,
    ATTEMPT_COUNTED,
    CANCELLED,
    CANCELLING,
    FAILED,
    QUEUED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    transition,
)

HANDBACK_FREE = 2  # hand-backs in a row queued again at once (a stopping worker, a blip)
HANDBACK_FIRST_S, HANDBACK_MAX_S = 5.0, 300.0
PENDING_REASON_CHARS = 300  # jobs.pending_reason


class Fenced(Exception):
    """A write for an attempt that is no longer active: the writer's token is stale."""

    def __init__(self, attempt_id: int, state: str | None):
        self.attempt_id, self.state = attempt_id, state
        super().__init__(f"attempt {attempt_id} is {state or 'gone'}: this write is refused")


def fence(session: Session, attempt_id: int) -> Attempt:
    """Lock the attempt's row for this transaction and check it is still active.

    The lock (FOR UPDATE on PostgreSQL; SQLite's BEGIN IMMEDIATE serialises writers
    already) makes the check hold until commit: `finish_attempt` elsewhere waits for it.
    A worker's flush fences with store.attempts.fence_flush: the same check and lock, as
    an UPDATE that also moves its events offset and bumps the job's version."""
    q = select(Attempt).where(Attempt.id == attempt_id).execution_options(populate_existing=True)
    if is_postgres(session):
        q = q.with_for_update()
    attempt = session.scalars(q).first()
    if attempt is None or attempt.state not in ATTEMPT_ACTIVE:
        raise Fenced(attempt_id, attempt.state if attempt is not None else None)
    return attempt


def _locked_job(session: Session, job_id: str) -> Job | None:
    q = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    if is_postgres(session):
        q = q.with_for_update()
    return session.scalars(q).first()


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


def mark_started(session: Session, attempt_id: int) -> None:
    """The trainer reported `started`: attempt running, and its job too unless a cancel
    came first (then the job stays cancelling and the supervisor stops the trainer)."""
    attempt = fence(session, attempt_id)
    if attempt.state != A_RUNNING:
        attempt.state = A_RUNNING
        bump_version_of_attempt(session, attempt_id)
    job = _locked_job(session, attempt.job_id)
    if job is not None and job.state == STARTING and job.attempt == attempt.number:
        transition(session, job, RUNNING, reason=f"attempt {attempt.number} started")


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
    - handed_back (a stopping worker, or preempted for a higher-priority job) -> job
      queued with attempt + 1, not counted;
    - failed with retryable=False (a deterministic error) -> job failed with `error`;
    - lost, or failed with retryable=True -> job queued with attempt + 1 while the failed
      and lost attempts number at most max_restarts, else failed.
    Returns the job's state afterwards, or None if the attempt had already ended.
    """
    attempt = _end_attempt(session, attempt_id, outcome, exit_code, reason)
    if attempt is None:
        return None
    job = _locked_job(session, attempt.job_id)
    if job is None:
        return None
    if job.attempt != attempt.number or job.state not in (STARTING, RUNNING, CANCELLING):
        return job.state  # an older attempt, or the API already ended the job
    _move_job(session, job, attempt, outcome, reason or outcome, error, retryable)
    return job.state


def _end_attempt(
    session: Session, attempt_id: int, outcome: str, exit_code: int | None, reason: str | None
) -> Attempt | None:
    """The attempt's row ends (once: None if it had ended already), and its ranks that never
    started are closed: a message for such a rank must not start it now."""
    now = utcnow()
    res = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.state.in_(ATTEMPT_ACTIVE))
        .values(state=outcome, exit_code=exit_code, reason=reason, ended_at=now)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        return None
    bump_version_of_attempt(session, attempt_id)  # GET shows the attempt's end
    session.execute(
        update(Assignment)
        .where(Assignment.attempt_id == attempt_id, Assignment.claimed_at.is_(None))
        .values(ended_at=now)
        .execution_options(synchronize_session=False)
    )
    return session.get(Attempt, attempt_id, populate_existing=True)


def _move_job(
    session: Session,
    job: Job,
    attempt: Attempt,
    outcome: str,
    why: str,
    error: str | None,
    retryable: bool,
) -> None:
    """What the attempt's end (`outcome`) does to its job (see `finish_attempt`)."""
    number = attempt.number
    if job.state == CANCELLING:
        transition(session, job, SUCCEEDED if outcome == A_SUCCEEDED else CANCELLED, reason=why)
    elif outcome == A_SUCCEEDED:
        if job.state == STARTING:
            # Finished before its `started` event was ingested: keep the history honest.
            transition(session, job, RUNNING, reason=f"attempt {number} started")
        transition(session, job, SUCCEEDED, reason=why)
    elif outcome == A_CANCELLED or (outcome == A_FAILED and not retryable):
        # A cancel nothing asked for (the job is not cancelling), or a deterministic error.
        transition(session, job, FAILED, reason=why, error=error or why)
    elif outcome == A_HANDED_BACK and attempt.preempted_by is not None:
        pending = f"preempted by job {attempt.preempted_by}; resumes from its checkpoint"
        _requeue(session, job, why, pending)
    elif outcome == A_HANDED_BACK and (rung := paused_rung(session, job.id)) is not None:
        pending = (
            f"paused at evaluation {rung} of its sweep (synchronous halving): waits until "
            "the trials still running reach this rung, then goes on from its checkpoint or "
            "is pruned"
        )
        _requeue(session, job, why, pending, hold_until=PAUSED_HOLD)
    elif outcome == A_HANDED_BACK:
        n, delay = handback_delay_s(session, job.id)
        if delay <= 0:
            _requeue(session, job, why, f"handed back: {why}")
        else:
            hold = db_now(session) + timedelta(seconds=delay)
            pending = (
                f"handed back {n} times in a row; backing off: not started again for "
                f"{delay:.0f}s (until {hold:%H:%M:%S} UTC); last: {why}"
            )
            _requeue(session, job, why, pending, hold_until=hold)
    else:
        n = counted_failures(session, job.id)
        if n <= job.max_restarts:
            _requeue(session, job, why, f"retrying after: {why}")
        else:
            msg = (
                f"{error or why} (gave up after {n} failed attempts, "
                f"max_restarts={job.max_restarts})"
            )
            transition(session, job, FAILED, reason=why, error=msg)


def handback_delay_s(session: Session, job_id: str) -> tuple[int, float]:
    """(the job's latest attempts handed back in a row, not for a preemption; how long it
    waits before it may start again: 0 for the first HANDBACK_FREE, then doubling)."""
    rows = session.execute(
        select(Attempt.state, Attempt.preempted_by, Attempt.reason)
        .where(Attempt.job_id == job_id)
        .order_by(Attempt.number.desc())
        .limit(HANDBACK_FREE + 16)
    ).all()
    n = 0
    for state, preempted_by, reason in rows:
        if state != A_HANDED_BACK or preempted_by is not None:
            break
        if (reason or "").startswith(PAUSED_AT):
            break  # a sweep's pause, not a failing host
        n += 1
    if n <= HANDBACK_FREE:
        return n, 0.0
    return n, min(HANDBACK_FIRST_S * 2 ** (n - HANDBACK_FREE - 1), HANDBACK_MAX_S)


def paused_rung(session: Session, job_id: str) -> int | None:
    """The rung a sweep trial's job is paused at, or None (not a paused trial)."""
    q = select(SweepTrial.paused_rung).where(
        SweepTrial.job_id == job_id, SweepTrial.outcome.is_(None)
    )
    return session.scalar(q)


def _requeue(
    session: Session, job: Job, why: str, pending: str, hold_until: datetime | None = None
) -> None:
    transition(session, job, QUEUED, reason=why, attempt=job.attempt + 1,
               pending_reason=pending[:PENDING_REASON_CHARS], hold_until=hold_until)  # fmt: skip
