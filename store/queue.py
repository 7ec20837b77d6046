"""What a scheduling pass reads and writes: the head of the queue, the idle workers, live
worker counts per kind, pending reasons, and the bulk write that starts a set of gangs.

Reads return small row tuples (never ORM objects, never a job's spec), and the writes are
a statement or two per table for the whole pass, so a pass over a big cluster costs a
handful of round trips whatever the number of jobs it starts. On PostgreSQL a batch travels
as one binary array per column (`unnest`), not as thousands of placeholders, and the
attempts, the assignments and the workers' claim are one statement. Which job goes where
is decided by `torchyard.scheduler`; this module only reads and writes.

Safety with several schedulers: on PostgreSQL the idle workers and queued jobs are
selected FOR UPDATE SKIP LOCKED, so two passes never see the same rows; on SQLite the
pass's transaction is BEGIN IMMEDIATE (store/db.py), which serialises writers. The writes
are conditional besides (worker idle -> busy, job queued -> starting, row counts checked):
a pass that finds any row changed under it rolls its savepoint back and writes nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Integer, String, case, func, insert, literal, or_, select, true, update
from sqlalchemy.orm import Session

from torchyard.store.dialect import db_now_value, is_postgres, unnest
from torchyard.store.models import (
    Assignment,
    Attempt,
    Job,
    User,
    UTCDateTime,
    Worker,
    table_of,
    utcnow,
)
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
    project_id: int | None = None  # None: its owner's personal project (older rows)


class FreeWorker(NamedTuple):
    id: str
    host: str
    device: str
    device_name: str | None
    queue: str
    warm: bool = False  # its warm trainer is ready (workers.warm_since is set)


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
        select(
            Worker.id,
            Worker.host,
            Worker.device,
            Worker.device_name,
            Worker.queue,
            Worker.warm_since.is_not(None),
        )
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
    Job.project_id,
)


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
    if lock:  # a pass starts no job that backs off after hand-backs (store/lifecycle.py)
        mine = mine.where(or_(Job.hold_until.is_(None), Job.hold_until <= db_now_value(session)))
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
    rank (rank i -> workers[i]), the workers busy with it, the jobs starting. Inside a
    savepoint; None (nothing written) when a worker or a job changed under the pass."""
    if not gangs:
        return []
    sp = session.begin_nested()
    if is_postgres(session):
        assignment_ids = _assign_pg(session, gangs)
    else:
        assignment_ids = _assign_sqlite(session, gangs)
    moved = [(j.id, j.attempt, f"assigned to {', '.join(w.id for w in ws)}") for j, ws in gangs]
    if assignment_ids is None or not transition_many(session, moved, QUEUED, STARTING):
        sp.rollback()
        return None
    sp.commit()
    ids = iter(assignment_ids)
    return [Started(j.id, next(ids), w.id, w.queue, r) for j, ws in gangs for r, w in enumerate(ws)]


def _assign_pg(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[int] | None:
    """The attempts, their assignments and the workers' claim in one statement (each rank
    joins its attempt by job id): the assignment ids in rank order, or None when a worker
    is no longer idle."""
    att_t, asg_t = table_of(Attempt), table_of(Assignment)
    # Columns with Python defaults given explicitly: two inserts in one statement would
    # otherwise both bind a parameter named "created_at".
    now = literal(utcnow(), UTCDateTime)
    g = unnest(
        "g",
        job=([j.id for j, _ in gangs], String()),
        number=([j.attempt for j, _ in gangs], Integer()),
        size=([len(ws) for _, ws in gangs], Integer()),
    )
    att = (
        insert(att_t)
        .from_select(
            ["job_id", "number", "world_size", "state", "events_offset", "created_at"],
            select(g.c.job, g.c.number, g.c.size, literal(A_STARTING), literal(0), now),
        )
        .returning(att_t.c.id, att_t.c.job_id)
        .cte("att")
    )
    r = unnest(
        "r",
        job=([j.id for j, ws in gangs for _ in ws], String()),
        rank=([i for _, ws in gangs for i in range(len(ws))], Integer()),
        worker=([w.id for _, ws in gangs for w in ws], String()),
    )
    rows = select(att.c.id, r.c.job, r.c.rank, r.c.worker, now).join_from(
        r, att, att.c.job_id == r.c.job
    )
    asg = (
        insert(asg_t)
        .from_select(["attempt_id", "job_id", "rank", "worker_id", "created_at"], rows)
        .returning(asg_t.c.id, asg_t.c.job_id, asg_t.c.worker_id)
        .cte("asg")
    )
    w_t = table_of(Worker)
    claim = (
        update(w_t)
        .where(w_t.c.id == asg.c.worker_id, w_t.c.state == IDLE)
        .values(state=BUSY, current_job_id=asg.c.job_id, current_assignment_id=asg.c.id)
        .returning(w_t.c.id)
        .cte("claim")
    )
    claimed = select(func.count()).select_from(claim).scalar_subquery()
    out = session.execute(select(asg.c.id, asg.c.worker_id, claimed)).all()
    if not out or out[0][2] != len(out):
        return None
    by_worker = {w: a for a, w, _ in out}  # a worker takes one rank a pass
    return [by_worker[w.id] for _, ws in gangs for w in ws]


def _assign_sqlite(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[int] | None:
    """`_assign_pg` on SQLite: a statement per table (executemany for the inserts)."""
    attempt_ids = _insert_attempts(session, gangs)
    ranks = [
        _Rank(aid, j.id, r, w)
        for aid, (j, ws) in zip(attempt_ids, gangs, strict=True)
        for r, w in enumerate(ws)
    ]
    assignment_ids = _insert_assignments(session, ranks)
    return assignment_ids if _claim_workers(session, ranks, assignment_ids) else None


class _Rank(NamedTuple):
    attempt_id: int
    job_id: str
    rank: int
    worker: FreeWorker


def _insert_attempts(
    session: Session, gangs: list[tuple[QueuedJob, list[FreeWorker]]]
) -> list[int]:
    """One attempt (number job.attempt, starting) per gang; their ids in gang order."""
    t = table_of(Attempt)
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
    t = table_of(Assignment)
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
    mine = (
        select(Assignment.id, Assignment.job_id)
        .where(Assignment.worker_id == Worker.id, Assignment.id.in_(assignment_ids))
        .correlate(Worker)
    )
    q = (
        update(Worker)
        .where(Worker.state == IDLE, Worker.id.in_([r.worker.id for r in ranks]))
        .values(
            state=BUSY,
            current_assignment_id=mine.with_only_columns(Assignment.id).scalar_subquery(),
            current_job_id=mine.with_only_columns(Assignment.job_id).scalar_subquery(),
        )
        .execution_options(synchronize_session=False)
    )
    return session.execute(q).rowcount == len(ranks)  # type: ignore[attr-defined]
