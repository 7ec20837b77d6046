"""What differs between PostgreSQL and SQLite, asked in one place."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.store.models import utcnow


def is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def db_now(session: Session) -> datetime:
    """The database's clock, for liveness: heartbeats and the reaper's cutoff are both
    read from it, so clock skew between worker hosts and the scheduler cannot reap a live
    worker. SQLite is local to one host, whose clock is the database's."""
    if not is_postgres(session):
        return utcnow()
    now = session.scalar(select(func.clock_timestamp()))
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


def db_now_value(session: Session) -> Any:
    """The database's clock as a value to write (no extra round trip on PostgreSQL)."""
    return func.now() if is_postgres(session) else utcnow()
