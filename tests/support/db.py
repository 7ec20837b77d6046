"""Database fixtures for the store and API tests, on the backend `db_backend` names: SQLite,
or PostgreSQL where reachable (always under CI); a module runs on one backend unless it
declares both (tests/support/backends.py, tests/BACKENDS.md). The schema is made by the
migrations (store.migrate.upgrade), once per session: SQLite tests copy a migrated template
file, PostgreSQL tests truncate every table of one migrated database."""

from __future__ import annotations

import itertools
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from specs import synthetic_spec
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from torchyard.settings import Settings
from torchyard.store import db as store_db
from torchyard.store.auth import create_token
from torchyard.store.db import session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import upgrade
from torchyard.store.models import Assignment, Attempt, Base, Job, Worker, utcnow
from torchyard.store.states import (
    CANCELLING,
    FAILED,
    QUEUED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    transition,
)

SPEC: dict[str, Any] = synthetic_spec()

# Paths to reach each state from queued, through the state machine.
_PATHS = {
    QUEUED: [],
    STARTING: [STARTING],
    RUNNING: [STARTING, RUNNING],
    SUCCEEDED: [STARTING, RUNNING, SUCCEEDED],
    FAILED: [STARTING, RUNNING, FAILED],
    CANCELLING: [STARTING, RUNNING, CANCELLING],
    "cancelled": ["cancelled"],
}


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_migrated(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


def _truncate(url: str) -> None:
    names = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with session_scope(url) as s:
        # audit_log's triggers refuse TRUNCATE (migration 0016); replica mode skips them
        # for this test-only reset (superuser only, as the tests' connection is).
        s.execute(text("SET LOCAL session_replication_role = replica"))
        s.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))


@contextmanager
def sqlite_copy(template: Path, tmp_path: Path) -> Iterator[str]:
    """A fresh copy of the migrated SQLite template: its URL (its engine disposed after)."""
    path = tmp_path / "torchyard.db"
    shutil.copyfile(template, path)
    url = f"sqlite:///{path}"
    try:
        yield url
    finally:
        engine = store_db._engines.pop(url, None)
        if engine is not None:
            engine.dispose()


@pytest.fixture
def db_url(db_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database on the test's backend."""
    if db_backend == "sqlite":
        with sqlite_copy(request.getfixturevalue("sqlite_template"), tmp_path) as url:
            yield url
    else:
        url = request.getfixturevalue("pg_migrated")
        _truncate(url)
        yield url


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        home=tmp_path / "home",
        database_url=db_url,
        storage_root=tmp_path / "storage",
        data_root=tmp_path / "data",
        broker_url=None,
    )


@pytest.fixture
def session(db_url: str) -> Iterator[Session]:
    with store_db.session_factory(db_url)() as s:
        yield s


class Factory:
    """Test data through the store's own functions, with keyword defaults."""

    _n = itertools.count()

    def __init__(self, url: str):
        self.url = url

    def token(self, user: str = "alice", admin: bool = False) -> str:
        with session_scope(self.url) as s:
            return create_token(s, user, admin=admin)

    def user_id(self, name: str) -> int:
        with session_scope(self.url) as s:
            from torchyard.store.auth import get_or_create_user

            return get_or_create_user(s, name).id

    def job(
        self,
        owner: str = "alice",
        state: str = QUEUED,
        spec: dict[str, Any] | None = None,
        **columns: Any,
    ) -> str:
        """A job of `owner` driven to `state` through store.states.transition."""
        uid = self.user_id(owner)
        body = dict(spec or SPEC)
        with session_scope(self.url) as s:
            job, _ = create_job(s, uid, body, name=body.get("name") or f"job-{next(self._n)}")
            for to in _PATHS[state]:
                transition(s, job, to, reason="test")
            for k, v in columns.items():
                setattr(job, k, v)
            return job.id

    def attempt(self, job_id: str, number: int = 1, workers: int = 1, **columns: Any) -> int:
        with session_scope(self.url) as s:
            a = Attempt(job_id=job_id, number=number, world_size=workers, **columns)
            s.add(a)
            s.flush()
            for rank in range(workers):
                wid = f"w{next(self._n)}"
                s.add(Worker(id=wid, host="h", pid=1, queue=f"q.{wid}", state="busy"))
                s.flush()
                s.add(Assignment(attempt_id=a.id, job_id=job_id, rank=rank, worker_id=wid))
            return a.id

    def worker(self, wid: str = "w-0", **columns: Any) -> str:
        with session_scope(self.url) as s:
            fields = {"host": "gpu-host", "pid": 123, "queue": f"q.{wid}", "gpu": 0, **columns}
            s.add(Worker(id=wid, last_heartbeat=utcnow(), **fields))
        return wid

    def set_pending(self, job_id: str, reason: str) -> None:
        """What a scheduling pass writes about a job it could not place."""
        with session_scope(self.url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            job.pending_reason = reason

    def set_state(self, job_id: str, to: str, **fields: Any) -> None:
        with session_scope(self.url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            transition(s, job, to, reason="test", **fields)


@pytest.fixture
def factory(db_url: str) -> Factory:
    return Factory(db_url)


@pytest.fixture
def empty_url(db_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database nobody has migrated yet (its own PostgreSQL database, dropped after)."""
    if db_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    base: str = request.getfixturevalue("pg_url")
    name = f"ty_mig_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
