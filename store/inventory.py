"""Read-only overviews for the API: the worker fleet and job counts by state."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.store.models import Job, Worker


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
