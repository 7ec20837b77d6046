"""Worker rows: registration, heartbeats, release after a job, clean deregistration, and
the reaper that declares silent workers lost and sends their jobs back to the queue.

States (named in store/states.py): idle (may be assigned), busy (holds an assignment),
lost (heartbeat stale), stopped (deregistered, or stopping: no new work). Only `idle`
workers with a fresh heartbeat are scheduled.

`warm_since`: since when the worker's warm trainer (worker/standby.py) has been ready to
take a one-rank job; null when it has none ready (starting, taken, dead, turned off).
Written with registration, every heartbeat and release (no extra statement), and by
`set_warm` when it changes between heartbeats; placement prefers warm workers
(scheduler/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, literal, or_, select, update
from sqlalchemy.orm import Session

from torchyard.store.attempts import (
    A_HANDED_BACK,
    ATTEMPT_ACTIVE,
    finish_attempt,
    hand_back_unclaimed,
    lose_attempt,
    lose_worker_assignments,
    unclaimed_since,
)
from torchyard.store.dialect import db_now, db_now_value, is_postgres
from torchyard.store.models import Assignment, Attempt, UTCDateTime, Worker, utcnow
from torchyard.store.states import W_BUSY, W_IDLE, W_LIVE, W_LOST, W_STOPPED

IDLE, BUSY, LOST, STOPPED, LIVE = W_IDLE, W_BUSY, W_LOST, W_STOPPED, W_LIVE


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    queue: str
    device: str = "cpu"
    gpu: int | None = None
    device_name: str | None = None
    memory_bytes: int | None = None
    warm: bool = False  # its warm trainer is ready now


def warm_value(session: Session, warm: bool) -> Any:
    """What `warm_since` becomes: kept while still warm, now (the database's clock) when it
    just became warm, null when not."""
    if not warm:
        return None
    now = db_now_value(session)
    if isinstance(now, datetime):  # SQLite: a value, bound as the column binds it
        now = literal(now, UTCDateTime)
    return func.coalesce(Worker.warm_since, now)


def register_worker(session: Session, info: WorkerInfo) -> list[str]:
    """Insert or refresh the worker's row as idle. A row still holding work from an earlier
    process of the same slot means that process died (its trainer died with it): those
    attempts are lost now rather than after a heartbeat timeout. Returns affected job ids."""
    lost_jobs = lose_worker_assignments(session, info.id, f"worker {info.id} restarted")
    now = utcnow()
    row = session.get(Worker, info.id, populate_existing=True)
    if row is None:
        row = Worker(id=info.id, registered_at=now)
        session.add(row)
    row.host, row.pid, row.queue = info.host, info.pid, info.queue
    row.device, row.gpu = info.device, info.gpu
    row.device_name, row.memory_bytes = info.device_name, info.memory_bytes
    row.state, row.current_job_id, row.current_assignment_id = IDLE, None, None
    # Liveness is judged on the database's clock, never a worker host's (clock skew).
    row.last_heartbeat, row.registered_at = db_now_value(session), now
    row.warm_since = row.last_heartbeat if info.warm else None
    session.flush()
    return lost_jobs


def heartbeat(session: Session, worker_id: str, warm: bool | None = None) -> str | None:
    """Refresh a live worker's heartbeat (and its warm mark, unless `warm` is None). Returns
    its state; `lost` means the reaper gave up on it (its attempt was re-queued), None that
    the row is gone."""
    values: dict[str, Any] = {"last_heartbeat": db_now_value(session)}
    if warm is not None:
        values["warm_since"] = warm_value(session, warm)
    session.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.state.in_(LIVE))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return session.scalar(select(Worker.state).where(Worker.id == worker_id))


def set_warm(session: Session, worker_id: str, warm: bool) -> None:
    """The worker's warm trainer became ready, or was taken or lost, between heartbeats."""
    session.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.state.in_(LIVE))
        .values(warm_since=warm_value(session, warm))
        .execution_options(synchronize_session=False)
    )


def release_worker(
    session: Session, worker_id: str, assignment_id: int, warm: bool | None = None
) -> bool:
    """Back to idle after the assignment ended (also from `lost`: the worker shows it is
    alive), with its warm mark unless `warm` is None. Conditional on still holding that
    assignment."""
    values: dict[str, Any] = {} if warm is None else {"warm_since": warm_value(session, warm)}
    res = session.execute(
        update(Worker)
        .where(
            Worker.id == worker_id,
            Worker.current_assignment_id == assignment_id,
            Worker.state.in_((BUSY, LOST)),
        )
        .values(
            state=IDLE,
            current_job_id=None,
            current_assignment_id=None,
            last_heartbeat=db_now_value(session),
            **values,
        )
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1  # type: ignore[attr-defined]


def stop_accepting(session: Session, worker_id: str) -> bool:
    """A stopping worker takes no new work: idle -> stopped (busy ones stop after their job)."""
    res = session.execute(
        update(Worker)
        .where(Worker.id == worker_id, Worker.state == IDLE)
        .values(state=STOPPED)
        .execution_options(synchronize_session=False)
    )
    return res.rowcount == 1  # type: ignore[attr-defined]


def deregister(session: Session, worker_id: str) -> list[str]:
    """The worker process is exiting: hand back anything assigned but not started; an
    attempt still running here (a stop that could not wait for the trainer, e.g. a second
    Ctrl-C) is lost, since nobody supervises it any more. Then state stopped."""
    jobs = hand_back_unclaimed(session, worker_id, f"worker {worker_id} stopped")
    jobs += lose_worker_assignments(
        session, worker_id, f"worker {worker_id} stopped while running it"
    )
    session.execute(
        update(Worker)
        .where(Worker.id == worker_id)
        .values(state=STOPPED, current_job_id=None, current_assignment_id=None, warm_since=None)
        .execution_options(synchronize_session=False)
    )
    return jobs


def stale_cutoff(session: Session, timeout_s: float, now: datetime | None = None) -> datetime:
    """Heartbeats older than this are stale, on the database's clock unless `now` is given."""
    return (now or db_now(session)) - timedelta(seconds=timeout_s)


def reap_stale_workers(
    session: Session, timeout_s: float, now: datetime | None = None
) -> list[tuple[str, list[str]]]:
    """Workers silent for longer than `timeout_s` become lost; their active attempts are
    lost too (jobs re-queued with attempt + 1, or failed once out of restarts).
    Returns (worker id, affected job ids) per reaped worker."""
    cutoff = stale_cutoff(session, timeout_s, now)
    q = select(Worker.id).where(Worker.state.in_(LIVE), Worker.last_heartbeat < cutoff)
    if is_postgres(session):
        q = q.with_for_update(skip_locked=True)
    reaped = []
    for (wid,) in session.execute(q).all():
        res = session.execute(
            update(Worker)
            .where(Worker.id == wid, Worker.state.in_(LIVE), Worker.last_heartbeat < cutoff)
            # It runs nothing now (its attempts are lost below, their jobs placed again), so
            # it names no job; the assignment stays its lease, for release_worker to take
            # it back to idle should it return and end that assignment.
            .values(state=LOST, current_job_id=None)
            .execution_options(synchronize_session=False)
        )
        if res.rowcount != 1:  # type: ignore[attr-defined]
            continue
        secs = int(timeout_s)
        jobs = lose_worker_assignments(
            session, wid, f"worker {wid} lost (no heartbeat for {secs}s)"
        )
        reaped.append((wid, jobs))
    return reaped


def lose_unsupervised_attempts(session: Session) -> list[str]:
    """Claimed ranks of active attempts that their worker no longer holds (it went idle or
    took other work without recording the end: a bug, or a crash between the two writes).
    Nobody will end those attempts, so they are lost now and the job retried, rather than
    left running forever. Returns the affected job ids."""
    rows = session.execute(
        select(Assignment.attempt_id, Assignment.job_id, Assignment.worker_id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .join(Worker, Worker.id == Assignment.worker_id)
        .where(
            Assignment.claimed_at.is_not(None),
            Assignment.ended_at.is_(None),
            Attempt.state.in_(ATTEMPT_ACTIVE),
            or_(
                Worker.current_assignment_id.is_(None),
                Worker.current_assignment_id != Assignment.id,
            ),
            Worker.state.in_(LIVE),
        )
    ).all()
    jobs = []
    for attempt_id, job_id, wid in rows:
        why = f"worker {wid} stopped supervising it without recording its end"
        if lose_attempt(session, attempt_id, why) is not None:
            jobs.append(job_id)
    return jobs


def release_orphaned_workers(session: Session, grace_s: float = 10.0) -> list[str]:
    """Busy workers whose assignment is over but who never went back to idle (a message
    that never arrived for an attempt that ended, or a crash between ending and releasing).
    Claimed assignments get `grace_s` for their worker to release itself."""
    old = utcnow() - timedelta(seconds=grace_s)
    rows = session.execute(
        select(Worker.id, Worker.current_assignment_id)
        .outerjoin(Assignment, Assignment.id == Worker.current_assignment_id)
        .outerjoin(Attempt, Attempt.id == Assignment.attempt_id)
        .where(
            Worker.state == BUSY,
            or_(
                Worker.current_assignment_id.is_(None),
                Assignment.id.is_(None),
                Assignment.ended_at < old,
                (Assignment.claimed_at.is_(None) & Attempt.state.not_in(ATTEMPT_ACTIVE)),
            ),
        )
    ).all()
    freed = []
    for wid, aid in rows:
        cond = (
            Worker.current_assignment_id.is_(None)
            if aid is None
            else Worker.current_assignment_id == aid
        )
        res = session.execute(
            update(Worker)
            .where(Worker.id == wid, Worker.state == BUSY, cond)
            .values(state=IDLE, current_job_id=None, current_assignment_id=None)
            .execution_options(synchronize_session=False)
        )
        if res.rowcount == 1:  # type: ignore[attr-defined]
            freed.append(wid)
    return freed


def expire_unclaimed(session: Session, timeout_s: float) -> list[tuple[str, str]]:
    """The claim deadline. A rank that no worker claimed within `timeout_s` (its worker's
    consumer hangs while its heartbeat thread lives, or the message and every re-send were
    lost) ends its attempt as handed back (not counted), so the job goes to other workers;
    the silent worker is marked lost and gets no new work until its consumer shows it is
    alive by registering again from inside a task. Returns (job id, worker id) pairs."""
    rows = session.execute(
        select(Assignment.attempt_id, Assignment.job_id, Assignment.worker_id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .where(*unclaimed_since(utcnow() - timedelta(seconds=timeout_s)))
    ).all()
    out = []
    for attempt_id, job_id, wid in rows:
        why = f"worker {wid} did not claim its rank within {timeout_s:g}s"
        if finish_attempt(session, attempt_id, A_HANDED_BACK, reason=why) is None:
            continue
        session.execute(
            update(Worker)
            .where(Worker.id == wid, Worker.state.in_(LIVE))
            .values(state=LOST, current_job_id=None, current_assignment_id=None)
            .execution_options(synchronize_session=False)
        )
        out.append((job_id, wid))
    return out
