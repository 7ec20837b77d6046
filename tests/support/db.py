"""The database fixtures every suite shares, registered once (tests/conftest.py's
`pytest_plugins`): `db_url`, a migrated and empty database on the backend `db_backend`
names (tests/support/backends.py: SQLite, or PostgreSQL where a module declares it, always
reachable under CI), and what stands on it: `settings`, `session`, `factory` (Factory:
test data through the store's own functions). `sqlite_url` is SQLite whatever the
backend; `empty_url` a database nobody has migrated. The schema is made by the migrations
(store.migrate.upgrade), once per session and backend.

SQLite: each test copies a migrated template file (`sqlite_template`).

PostgreSQL: one migrated database per session (`pg_migrated`, in tests/conftest.py's
`pg_url`), emptied before each test by `empty_postgres`: DELETE FROM every table, children
first (Base.metadata.sorted_tables reversed), then each table's id sequence set back to 1
as TRUNCATE's RESTART IDENTITY did (tests rely on it: tests/api/test_api_fanout.py resumes
a feed at FeedCursor(event=2, metric=1), ids of the test's first job). One transaction in
replica mode (`session_replication_role`: audit_log's triggers refuse a DELETE or a
TRUNCATE, migration 0016; replica mode skips them for this test-only reset, and the
foreign keys' triggers; superuser only, as the tests' connection is).

Measured on this 2-core machine, db_url's setup per PostgreSQL test (--timing-report's
sum over the 108 cases of tests/api, the session's one migration included; the two
versions run in turn, another suite running beside them at times):

    CI=true .venv/bin/python -m pytest tests/api -m postgres --timing-report /tmp/t.json

(in /tmp/t.json's "fixtures", db_url's "s" / "setups"). TRUNCATE … RESTART IDENTITY
CASCADE, what this did before: 0.09, 0.18, 0.40 and 0.73 s per test in four runs (the 111
tests in 1:26 to 5:35 min); DELETE and the sequences reset: 0.008, 0.014 and 0.023 s in
three (1:21 to 1:52 min). Timed alone by a throw-away script, 40 rounds each after a
typical test's rows (2 tokens, 3 jobs, an attempt of 2 workers): TRUNCATE 285-430 ms
median, DELETE 4-8 ms with or without the sequences reset. TRUNCATE costs per table (26
tables: each gets new, empty files) however few rows there are; DELETE costs per row, and
a test writes few.

One database for all of a process's tests is safe because they run one after another and
none leaves a thread or a process writing past its end: the worker and scheduler tests had
a fresh database each so that "other test modules' jobs never reach our scheduler", but
their threads and processes (schedulers racing, heartbeat threads, supervised trainers)
are joined or stopped before each test ends. What the store remembers per process of a
database (each user's sandbox uid, by URL and user id) is forgotten with its rows
(_forget: without it, the two users of tests/worker/test_hostile_tenants.py got one uid,
the one a previous test's user of the same id had). What outlives one test, a module's
cluster of real processes (tests/support/worker_cluster.py, the dashboard's), takes
databases of its own: `new_pg_database`, copies of a migrated template (CREATE DATABASE …
TEMPLATE)."""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from specs import synthetic_spec
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from torchyard.settings import Settings
from torchyard.store import bundles as store_bundles
from torchyard.store import db as store_db
from torchyard.store import sandboxuids
from torchyard.store.auth import create_token
from torchyard.store.db import dispose_engines, session_scope
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
STATE_PATHS = {
    QUEUED: [],
    STARTING: [STARTING],
    RUNNING: [STARTING, RUNNING],
    SUCCEEDED: [STARTING, RUNNING, SUCCEEDED],
    FAILED: [STARTING, RUNNING, FAILED],
    CANCELLING: [STARTING, RUNNING, CANCELLING],
    "cancelled": ["cancelled"],
}

# Every table, children first: the order a DELETE of all rows takes.
_TABLES = [t.name for t in reversed(Base.metadata.sorted_tables)]
_EMPTY_ALL = "; ".join(f"DELETE FROM {name}" for name in _TABLES)
# The sequences those tables' columns own (their ids), found once per database URL.
_OWNED_SEQUENCES = text(
    "SELECT s.oid::regclass::text FROM pg_class s"
    " JOIN pg_depend d ON d.objid = s.oid AND d.classid = 'pg_class'::regclass"
    " AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')"
    " JOIN pg_class t ON t.oid = d.refobjid"
    " WHERE s.relkind = 'S' AND t.relname = ANY(:tables) ORDER BY 1"
)
_RESTART: dict[str, str] = {}  # URL -> the statement setting each of them back to 1


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_migrated(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


def empty_postgres(url: str) -> None:
    """Every table of the migrated PostgreSQL database at `url` emptied and its ids started
    again at 1, as after TRUNCATE … RESTART IDENTITY (module docstring); what this process
    remembers of that database forgotten (_forget)."""
    with session_scope(url) as s:
        if url not in _RESTART:
            owned = s.scalars(_OWNED_SEQUENCES, {"tables": _TABLES})
            resets = ", ".join(f"setval('{n}', 1, false)" for n in owned)
            _RESTART[url] = f"SELECT {resets or 1}"
        s.execute(text("SET LOCAL session_replication_role = replica"))
        s.connection().exec_driver_sql(_EMPTY_ALL)
        s.connection().exec_driver_sql(_RESTART[url])
    _forget(url)


def _forget(url: str) -> None:
    """The store's per-process memory of the database at `url`, which assumes rows are never
    removed: each user's sandbox uid (store/sandboxuids.py: user 1's would be another
    test's user 1's, and two users got one uid) and when unused bundles were last removed
    (store/bundles.py). Emptied, the database is a new one to them, as a fresh one was."""
    with sandboxuids._lock:
        for key in [k for k in sandboxuids._known if k[0] == url]:
            del sandboxuids._known[key]
    with store_bundles._cleanup_lock:
        store_bundles._last_cleanup.pop(url, None)


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
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty SQLite database, whatever the test's backend."""
    with sqlite_copy(sqlite_template, tmp_path) as url:
        yield url


@pytest.fixture
def db_url(db_backend: str, request: pytest.FixtureRequest) -> str:
    """A migrated, empty database on the test's backend."""
    if db_backend == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    url: str = request.getfixturevalue("pg_migrated")
    empty_postgres(url)
    return url


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
            for to in STATE_PATHS[state]:
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


# ---- databases of their own, for worlds of real processes (a module's cluster) ------------

_PG_TEMPLATES: dict[str, str] = {}  # admin URL -> this process's migrated template database


def _pg_template(admin_url: str) -> str:
    """The name of this process's migrated template database on `admin_url`'s server: every
    database new_pg_database makes is a copy of it (CREATE DATABASE … TEMPLATE), the same
    schema at a fraction of the cost of running the migrations again."""
    name = _PG_TEMPLATES.get(admin_url)
    if name is None:
        name = f"ty_tpl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        eng = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with eng.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        eng.dispose()
        upgrade(admin_url.rsplit("/", 1)[0] + f"/{name}")
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
    migrated template); drop_pg_databases drops them."""
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
