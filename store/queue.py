"""What a scheduling pass reads and writes: the head of the queue, the idle workers, live
worker counts per kind, pending reasons, and the bulk write that starts a set of gangs.

Reads return small row tuples (never ORM objects, never a job's spec), and the writes are
one statement per table for the whole pass, so a pass over a big cluster costs a handful of
round trips whatever the number of jobs it starts. On PostgreSQL a batch travels as one
array per column (`unnest`), not as thousands of placeholders. Which job goes where is decided by
`torchyard.scheduler`; this module only reads and writes.

Safety with several schedulers: on PostgreSQL the idle workers and queued jobs are
selected FOR UPDATE SKIP LOCKED, so two passes never see the same rows; on SQLite the
pass's transaction is BEGIN IMMEDIATE (store/db.py), which serialises writers. The writes
are conditional besides (worker idle -> busy, job queued -> starting, row counts checked):
a pass that finds any row changed under it rolls its savepoint back and writes nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Integer, String, case, func, insert, literal, select, true, update
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres, unnest
from torchyard.store.models import Assignment, Attempt, Job, User, Worker
from torchyard.store.states import A_STARTING, QUEUED, STARTING, transition_many
from torchyard.store.workers import BUSY, IDLE, LIVE


class QueuedJob(NamedTuple):
    id: str
    world_size: int
    created_at: datetime
    attempt: int
    pending_reason: str | None
    owner_id: int = 0
    priority: int = 0


class FreeWorker(NamedTuple):
    id: str
    host: str
    device: str
    device_name: str | None
    queue: str


class Started(NamedTuple):
    """One rank of a gang the pass started: its message goes to `queue` after the commit."""

    job_id: str
    assignment_id: int
    worker_id: str
    queue: str
    rank: int


def idle_workers(session: Session, cutoff: datetime) -> list[FreeWorker]:
    """Idle workers whose heartbeat is newer than `cutoff`, by host then id."""
    q = (
        select(Worker.id, Worker.host, Worker.device, Worker.device_name, Worker.queue)
        .where(Worker.state == IDLE, Worker.last_heartbeat >= cutoff)
        .order_by(Worker.host, Worker.id)
    )
    if is_postgres(session):
        q = q.with_for_update(skip_locked=True)
    return [FreeWorker(*row) for row in session.execute(q)]


_QUEUED_COLS = (
    Job.id,
    Job.world_size,
    Job.created_at,
    Job.attempt,
    Job.pending_reason,
    Job.owner_id,
    Job.priority,
)


def queue_head(session: Session, limit: int) -> list[QueuedJob]:
    """The first `limit` queued jobs by priority, then age (the partial index
    ix_jobs_queued_order serves exactly this order)."""
    if limit <= 0:
        return []
    q = (
        select(*_QUEUED_COLS)
        .where(Job.state == QUEUED)
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(limit)
    )
    if is_postgres(session):
        q = q.with_for_update(skip_locked=True)
    return [QueuedJob(*row) for row in session.execute(q)]


def queue_heads(session: Session, limit: int, *, lock: bool = True) -> list[QueuedJob]:
    """The first `limit` queued jobs of every user, by priority then age: fair share may
    put any user's head first, so each is read apart (one index probe per user on
    ix_jobs_queued_owner_order; one LATERAL statement on PostgreSQL)."""
    if limit <= 0:
        return []
    mine = (
        select(*_QUEUED_COLS)
        .where(Job.state == QUEUED)
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(limit)
    )
    if is_postgres(session):
        head = mine.where(Job.owner_id == User.id)
        if lock:  # a pass's read: two schedulers never take the same job
            head = head.with_for_update(skip_locked=True)
        lat = head.lateral("head")
        rows = session.execute(select(lat).select_from(User).join(lat, true()))
        return [QueuedJob(*row) for row in rows]
    owners = session.scalars(select(User.id).order_by(User.id)).all()
    return [
        QueuedJob(*row)
        for uid in owners
        for row in session.execute(mine.where(Job.owner_id == uid))
    ]


def live_counts(session: Session, cutoff: datetime) -> list[tuple[str, str | None, int]]:
    """(device, device name, live workers) for workers idle or busy with a fresh heartbeat."""
    rows = session.execute(
        select(Worker.device, Worker.device_name, func.count())
        .where(Worker.state.in_(LIVE), Worker.last_heartbeat >= cutoff)
        .group_by(Worker.device, Worker.device_name)
    )
    return [(device, name, int(n)) for device, name, n in rows]


def set_pending_reasons(session: Session, reasons: dict[str, str]) -> None:
    """Record why each job still waits (only for jobs still queued), in one statement."""
    if not reasons:
        return
    q = update(Job).where(Job.state == QUEUED).execution_options(synchronize_session=False)
    if is_postgres(session):
        u = unnest("u", jid=(list(reasons), String()), why=(list(reasons.values()), String()))
        session.execute(q.where(Job.id == u.c.jid).values(pending_reason=u.c.why))
    else:
        why = case(reasons, value=Job.id)
        session.execute(q.where(Job.id.in_(list(reasons))).values(pending_reason=why))


def start_gangs(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[Started] | None:
    """Start every (job, workers) gang at once: one attempt per job with one assignment per
    rank (rank i -> workers[i]), the workers busy with it, the jobs starting; a statement
    per table. Inside a savepoint; None (nothing written) when a worker or a job changed
    under the pass."""
    if not gangs:
        return []
    sp = session.begin_nested()
    attempt_ids = _insert_attempts(session, gangs)
    ranks = [
        _Rank(aid, j.id, r, w)
        for aid, (j, ws) in zip(attempt_ids, gangs, strict=True)
        for r, w in enumerate(ws)
    ]
    assignment_ids = _insert_assignments(session, ranks)
    moved = [(j.id, j.attempt, f"assigned to {', '.join(w.id for w in ws)}") for j, ws in gangs]
    if not _claim_workers(session, ranks, assignment_ids) or (
        not transition_many(session, moved, QUEUED, STARTING)
    ):
        sp.rollback()
        return None
    sp.commit()
    return [
        Started(r.job_id, a, r.worker.id, r.worker.queue, r.rank)
        for a, r in zip(assignment_ids, ranks, strict=True)
    ]


class _Rank(NamedTuple):
    attempt_id: int
    job_id: str
    rank: int
    worker: FreeWorker


def _insert_attempts(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[int]:
    """One attempt (number job.attempt, starting) per gang; their ids in gang order."""
    t = Attempt.__table__
    if is_postgres(session):
        u = unnest(
            "u",
            job=([j.id for j, _ in gangs], String()),
            number=([j.attempt for j, _ in gangs], Integer()),
            size=([len(ws) for _, ws in gangs], Integer()),
        )
        rows = select(u.c.job, u.c.number, u.c.size, literal(A_STARTING))
        ins = insert(t).from_select(["job_id", "number", "world_size", "state"], rows)
        by_job = {j: a for a, j in session.execute(ins.returning(t.c.id, t.c.job_id))}
        return [by_job[j.id] for j, _ in gangs]
    return list(
        session.scalars(
            insert(t).returning(t.c.id, sort_by_parameter_order=True),
            [
                {"job_id": j.id, "number": j.attempt, "world_size": len(ws), "state": A_STARTING}
                for j, ws in gangs
            ],
        )
    )


def _insert_assignments(session: Session, ranks: list[_Rank]) -> list[int]:
    """One assignment per rank; their ids in rank order."""
    t = Assignment.__table__
    if is_postgres(session):
        u = unnest(
            "u",
            attempt=([r.attempt_id for r in ranks], Integer()),
            job=([r.job_id for r in ranks], String()),
            rank=([r.rank for r in ranks], Integer()),
            worker=([r.worker.id for r in ranks], String()),
        )
        rows = select(u.c.attempt, u.c.job, u.c.rank, u.c.worker)
        ins = insert(t).from_select(["attempt_id", "job_id", "rank", "worker_id"], rows)
        by_worker = {w: a for a, w in session.execute(ins.returning(t.c.id, t.c.worker_id))}
        return [by_worker[r.worker.id] for r in ranks]  # a worker takes one rank a pass
    return list(
        session.scalars(
            insert(t).returning(t.c.id, sort_by_parameter_order=True),
            [
                {
                    "attempt_id": r.attempt_id,
                    "job_id": r.job_id,
                    "rank": r.rank,
                    "worker_id": r.worker.id,
                }
                for r in ranks
            ],
        )
    )


def _claim_workers(session: Session, ranks: list[_Rank], assignment_ids: list[int]) -> bool:
    """idle -> busy, holding its new assignment (and job) each, in one statement; False when
    any worker is no longer idle."""
    q = (
        update(Worker)
        .where(Worker.state == IDLE)
        .values(state=BUSY)
        .execution_options(synchronize_session=False)
    )
    if is_postgres(session):
        u = unnest(
            "u",
            wid=([r.worker.id for r in ranks], String()),
            job=([r.job_id for r in ranks], String()),
            aid=(assignment_ids, Integer()),
        )
        q = q.where(Worker.id == u.c.wid).values(
            current_job_id=u.c.job, current_assignment_id=u.c.aid
        )
    else:
        mine = (
            select(Assignment.id, Assignment.job_id)
            .where(Assignment.worker_id == Worker.id, Assignment.id.in_(assignment_ids))
            .correlate(Worker)
        )
        q = q.where(Worker.id.in_([r.worker.id for r in ranks])).values(
            current_assignment_id=mine.with_only_columns(Assignment.id).scalar_subquery(),
            current_job_id=mine.with_only_columns(Assignment.job_id).scalar_subquery(),
        )
    return session.execute(q).rowcount == len(ranks)  # type: ignore[attr-defined]
