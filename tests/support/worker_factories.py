"""Factories with keyword defaults for the worker tests."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from specs import digits_spec
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from torchyard.settings import Settings
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.models import Job, User, Worker, utcnow
from torchyard.store.sandboxuids import sandbox_uid

DIGITS_SPEC: dict[str, Any] = digits_spec()


# The migrations run once per test process and backend: every fresh database after that
# is a copy of a migrated template (a file copy for SQLite, PostgreSQL's CREATE DATABASE
# … TEMPLATE), the same schema at a fraction of the cost of 18 migrations per test.
_SQLITE_TEMPLATE: list[Path] = []
_PG_TEMPLATES: dict[str, str] = {}  # admin URL -> its migrated template database


def create_schema(url: str) -> None:
    """Migrate the SQLite file or PostgreSQL database at `url` (an empty one)."""
    from torchyard.store.migrate import upgrade

    upgrade(url)


def sqlite_schema(path: Path) -> str:
    """A migrated SQLite database at `path` (a copy of the process's template): its URL."""
    if not _SQLITE_TEMPLATE:
        tmpl = Path(tempfile.mkdtemp(prefix="ty-schema-")) / "template.db"
        url = f"sqlite:///{tmpl}"
        create_schema(url)
        dispose_engines()
        atexit.register(shutil.rmtree, tmpl.parent, True)
        _SQLITE_TEMPLATE.append(tmpl)
    shutil.copyfile(_SQLITE_TEMPLATE[0], path)
    return f"sqlite:///{path}"


def _pg_template(admin_url: str) -> str:
    """The name of this process's migrated template database on `admin_url`'s server."""
    name = _PG_TEMPLATES.get(admin_url)
    if name is None:
        name = f"ty_tpl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        eng.dispose()
        create_schema(admin_url.rsplit("/", 1)[0] + f"/{name}")
        dispose_engines()  # a template must have no connection while it is copied
        atexit.register(_drop_pg, admin_url, name)
        _PG_TEMPLATES[admin_url] = name
    return name


def _drop_pg(admin_url: str, name: str) -> None:
    eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        eng.dispose()


def new_pg_database(pg_url: str) -> Callable[[], str]:
    """Creates migrated databases next to the session's PostgreSQL database (copies of a
    migrated template); dropped at exit."""
    base = pg_url.rsplit("/", 1)[0]
    admin_url = base + "/postgres"
    made: list[str] = []

    def make() -> str:
        template = _pg_template(admin_url)
        name = f"ty_worker_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
        eng.dispose()
        made.append(name)
        return f"{base}/{name}"

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


def warm_for(launcher: object, settings: Settings, db_url: str, owner: str = "alice") -> None:
    """A sandbox slot's next zygote serves `owner`, as on a slot whose last job was theirs
    (a zygote runs one user's uid: worker/launch_sandbox.py). Other launchers: nothing."""
    if not hasattr(launcher, "_next"):
        return
    with session_scope(db_url) as s:
        user_id = make_user(s, owner).id
    launcher._next = (sandbox_uid(settings, user_id), user_id)
