"""Read-only overviews for the API: the worker fleet and job counts by state."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.store.models import Job, User, Worker
from torchyard.store.states import QUEUED


def list_workers(session: Session) -> list[Worker]:
    """Every registered worker (live or not), by id."""
    return list(session.scalars(select(Worker).order_by(Worker.id)))


def job_counts(session: Session) -> dict[str, int]:
    return {
        s: int(n) for s, n in session.execute(select(Job.state, func.count()).group_by(Job.state))
    }


def worker_counts(session: Session) -> dict[str, int]:
    return {
        s: int(n)
        for s, n in session.execute(select(Worker.state, func.count()).group_by(Worker.state))
    }


def queued_by_owner(session: Session) -> dict[int, int]:
    """Queued jobs per user id (users with none are absent): one aggregate on the state
    index, exact however long the queue is."""
    rows = session.execute(
        select(Job.owner_id, func.count()).where(Job.state == QUEUED).group_by(Job.owner_id)
    )
    return {int(uid): int(n) for uid, n in rows}


def job_names(session: Session, job_ids: list[str]) -> dict[str, str]:
    if not job_ids:
        return {}
    rows = session.execute(select(Job.id, Job.name).where(Job.id.in_(job_ids)))
    return {job_id: name for job_id, name in rows}


def users_by_id(session: Session, user_ids: set[int]) -> dict[int, User]:
    if not user_ids:
        return {}
    return {u.id: u for u in session.scalars(select(User).where(User.id.in_(user_ids)))}
