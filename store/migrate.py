"""Alembic, driven from Python: `upgrade(url)` is what `torchyard db upgrade` runs, and
`wait_for_schema(url)` is what the api, scheduler and worker run before they start.

An upgrade is run by one process at a time: on PostgreSQL it holds a session advisory lock
while it migrates, so a second `db upgrade` (another host's compose file, a retried
one-shot) waits for the first and then finds nothing left to do, instead of running the same
DDL twice. SQLite needs no lock: one host only, and every migration runs inside one BEGIN
IMMEDIATE transaction there (store/db.py), which serialises writers anyway.

A service never runs against a schema other than its own: behind (an upgrade still to run,
or running) it waits, saying so; ahead (a newer release migrated the database) it refuses at
once, since its queries would fail or, worse, write rows the newer code misreads; and one
already running stops when another host's upgrade moves the database past it
(`start_schema_watch`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import text

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# pg_advisory_lock's key for "migrating this database": "torchyar" as a big-endian int64.
MIGRATION_LOCK_KEY = int.from_bytes(b"torchyar", "big")
SCHEMA_POLL_S = 2.0
SAY_EVERY_S = 15.0


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a URL (encoded password) must be doubled.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(
    database_url: str, revision: str = "head", say: Callable[[str], None] | None = None
) -> None:
    """Migrate the database at `database_url` to `revision` (default: the newest), holding
    the migration lock (PostgreSQL) so that concurrent upgrades run one after the other."""
    with migration_lock(database_url, say or _stderr):
        command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    with migration_lock(database_url, _stderr):
        command.downgrade(alembic_config(database_url), revision)


@contextlib.contextmanager
def migration_lock(database_url: str, say: Callable[[str], None]) -> Iterator[None]:
    """PostgreSQL: a session advisory lock on a connection of its own, held while the
    caller migrates on another; it goes with that connection if this process dies. Other
    databases: nothing (see the module's docstring)."""
    if not database_url.startswith("postgresql"):
        yield
        return
    from torchyard.store.db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            got = conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            if not got:
                say("another `torchyard db upgrade` is migrating this database: waiting for it")
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
    finally:
        engine.dispose()


def current(database_url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    from torchyard.store.db import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision this code knows (the migrations form one line: one head)."""
    return ScriptDirectory.from_config(alembic_config("")).get_current_head() or ""


@dataclass(frozen=True)
class SchemaState:
    """Where the database's schema stands against this code's: `ready`, `behind` (an
    upgrade is due: wait), or `ahead` (a newer release's: refuse)."""

    state: str
    current: str | None
    head: str

    def at(self) -> str:
        return f"the database is at schema revision {self.current or 'none (never migrated)'}"

    def message(self) -> str:
        if self.state == "ahead":
            return (
                f"{self.at()}, which this torchyard (schema {self.head}) does not know: a "
                "newer release migrated it. Run that release, or restore the backup taken "
                "before the upgrade (README: Backup and restore)"
            )
        return f"{self.at()}; this torchyard needs {self.head}: waiting for `torchyard db upgrade`"

    def gave_up(self, timeout_s: float) -> str:
        return (
            f"{self.at()}; this torchyard needs {self.head}, and no `torchyard db upgrade` "
            f"brought it there within TORCHYARD_SCHEMA_WAIT_S={timeout_s:g}s"
        )


def schema_state(database_url: str) -> SchemaState:
    """Reads the database's revision (raises what the driver raises when it cannot)."""
    want = head()
    at = current(database_url)
    if at == want:
        return SchemaState("ready", at, want)
    if at is None:
        return SchemaState("behind", at, want)
    try:
        known = ScriptDirectory.from_config(alembic_config("")).get_revision(at)
    except CommandError:
        known = None
    return SchemaState("behind" if known is not None else "ahead", at, want)


def wait_for_schema(
    database_url: str,
    timeout_s: float,
    say: Callable[[str], None] | None = None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str | None:
    """Until the database is at this code's schema: None once it is, else why not (the
    caller exits with it). A database that cannot be reached is not waited for here: each
    service already rides out a database outage its own way, and checks nothing it cannot
    read (said once)."""
    say = say or _stderr
    start = last_said = clock()
    said = False
    while True:
        try:
            st = schema_state(database_url)
        except Exception as e:  # unreachable, refused: not this check's business
            say(f"schema not checked: the database cannot be read now ({type(e).__name__})")
            return None
        if st.state == "ready":
            if said:
                say(f"the database is at schema revision {st.current}: starting")
            return None
        if st.state == "ahead":
            return st.message()
        if clock() - start >= timeout_s:
            return st.gave_up(timeout_s)
        if not said or clock() - last_said >= SAY_EVERY_S:
            say(st.message())
            said, last_said = True, clock()
        sleep(SCHEMA_POLL_S)


def start_schema_watch(
    database_url: str,
    every_s: float,
    prog: str,
    *,
    stop: Callable[[], None] | None = None,
) -> threading.Thread | None:
    """A daemon thread that reads the database's revision every `every_s` seconds and,
    once a newer release has migrated it (a revision this code does not know: another
    host's upgrade), says so and stops this process as SIGTERM does (a worker checkpoints
    its trainer and hands the job back, uncounted): old code never goes on writing to a
    schema it does not know. Restarted on the old image, the process then refuses to start
    (`wait_for_schema`). Errors reading the revision are skipped (the next read retries).
    None when `every_s` is 0 (off)."""
    if every_s <= 0:
        return None
    halt = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))

    def watch() -> None:
        while True:
            time.sleep(every_s)
            try:
                st = schema_state(database_url)
            except Exception:
                continue
            if st.state == "ahead":
                _stderr(f"torchyard {prog}: {st.message()}. Stopping, as on SIGTERM")
                halt()
                return

    t = threading.Thread(target=watch, name="schema-watch", daemon=True)
    t.start()
    return t


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
