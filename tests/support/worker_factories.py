"""Factories with keyword defaults for the worker and scheduler tests: rows written
straight through a session (the store's own functions are support.db's Factory)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from specs import digits_spec
from sqlalchemy.orm import Session

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Job, User, Worker, utcnow
from torchyard.store.sandboxuids import sandbox_uid

DIGITS_SPEC: dict[str, Any] = digits_spec()


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


def warm_for(launcher: object, settings: Settings, db_url: str, owner: str = "alice") -> None:
    """A sandbox slot's next zygote serves `owner`, as on a slot whose last job was theirs
    (a zygote runs one user's uid: worker/launch_sandbox.py). Other launchers: nothing."""
    if not hasattr(launcher, "_next"):
        return
    with session_scope(db_url) as s:
        user_id = make_user(s, owner).id
    launcher._next = (sandbox_uid(settings, user_id), user_id)
