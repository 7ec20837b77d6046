"""Factories with keyword defaults for the worker tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from specs import digits_spec
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from torchyard.store.db import dispose_engines
from torchyard.store.models import Job, User, Worker, utcnow

DIGITS_SPEC: dict[str, Any] = digits_spec()


def create_schema(url: str) -> None:
    try:
        from torchyard.store.migrate import upgrade
    except ImportError:  # before migrations existed; tests only
        from torchyard.store.db import get_engine
        from torchyard.store.models import Base

        Base.metadata.create_all(get_engine(url))
        return
    upgrade(url)


def new_pg_database(pg_url: str) -> Callable[[], str]:
    """Creates empty databases next to the session's PostgreSQL database; dropped at exit."""
    base = pg_url.rsplit("/", 1)[0]
    admin_url = base + "/postgres"
    made: list[str] = []

    def make() -> str:
        name = f"ty_worker_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        eng.dispose()
        made.append(name)
        url = f"{base}/{name}"
        create_schema(url)
        return url

    make.made = made  # type: ignore[attr-defined]
    make.admin_url = admin_url  # type: ignore[attr-defined]
    return make


def drop_pg_databases(make: Callable[[], str]) -> None:
    dispose_engines()
    eng = create_engine(make.admin_url, isolation_level="AUTOCOMMIT")  # type: ignore[attr-defined]
    with eng.connect() as c:
        for name in make.made:  # type: ignore[attr-defined]
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    eng.dispose()


def make_user(s: Session, name: str = "alice") -> User:
    u = s.query(User).filter_by(name=name).one_or_none()
    if u is None:
        u = User(name=name)
        s.add(u)
        s.flush()
    return u


def make_job(
    s: Session,
    *,
    world_size: int = 1,
    priority: int = 0,
    max_restarts: int = 2,
    age_s: float = 0.0,
    state: str = "queued",
    spec: dict[str, Any] | None = None,
    name: str = "job",
    owner: str = "alice",
    preemptible: bool = True,
) -> Job:
    spec = dict(spec or DIGITS_SPEC)
    spec["world_size"] = world_size
    job = Job(
        owner_id=make_user(s, owner).id,
        name=name,
        spec=spec,
        world_size=world_size,
        priority=priority,
        preemptible=preemptible,
        max_restarts=max_restarts,
        state=state,
        created_at=utcnow() - timedelta(seconds=age_s),
    )
    s.add(job)
    s.flush()
    return job


def make_worker(
    s: Session,
    wid: str,
    *,
    host: str = "h1",
    state: str = "idle",
    heartbeat: datetime | None = None,
) -> Worker:
    w = Worker(
        id=wid,
        host=host,
        pid=1,
        queue=f"q.{wid}",
        state=state,
        last_heartbeat=heartbeat or utcnow(),
    )
    s.add(w)
    s.flush()
    return w
