"""Upgrades run once and services wait for them (store/migrate.py): concurrent `torchyard db
upgrade` processes take turns on PostgreSQL's advisory lock, and the api (like the
scheduler and the worker) starts only on its own schema: behind, it waits for the upgrade;
ahead (a newer release's), it refuses at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from support.backends import only

from torchyard.store import migrate
from torchyard.store.db import make_engine

ROOT = Path(__file__).resolve().parents[2]
OLDER = "0015"  # a revision some releases ago: the schema an older image left
DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md
PG_ONLY = only("postgres")  # PostgreSQL's advisory lock


def _env(url: str, tmp_path: Path, **more: str) -> dict[str, str]:
    return os.environ | {
        "TORCHYARD_DATABASE_URL": url,
        "TORCHYARD_STORAGE_ROOT": str(tmp_path / "storage"),
        "TORCHYARD_HOME": str(tmp_path / "home"),
        "PYTHONUNBUFFERED": "1",
        **more,
    }


def _torchyard(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchyard", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stamp(url: str, revision: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    finally:
        engine.dispose()


def _read_until(p: subprocess.Popen[str], needle: str, timeout: float = 60) -> str:
    """The process's output up to the first line holding `needle` (fails at its exit)."""
    assert p.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never said {needle!r}:\n{''.join(seen)}")


@PG_ONLY
def test_concurrent_upgrades_take_turns_and_both_succeed(empty_url: str, tmp_path: Path) -> None:
    """While another upgrade holds the lock, two more wait (and migrate nothing); once it is
    released, one migrates, the other finds nothing to do, and both exit 0."""
    engine = make_engine(empty_url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as held:
            held.execute(text("SELECT pg_advisory_lock(:k)"), {"k": migrate.MIGRATION_LOCK_KEY})
            procs = [_torchyard("db", "upgrade", env=_env(empty_url, tmp_path)) for _ in "ab"]
            for p in procs:
                _read_until(p, "is migrating this database: waiting for it")
            time.sleep(0.5)
            assert migrate.current(empty_url) is None  # nobody migrated behind the lock
            held.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": migrate.MIGRATION_LOCK_KEY})
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        with engine.connect() as c:
            rows = c.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        assert rows == [migrate.head()]
    finally:
        engine.dispose()


def test_schema_states(empty_url: str) -> None:
    assert migrate.schema_state(empty_url).state == "behind"  # never migrated
    migrate.upgrade(empty_url, OLDER)
    st = migrate.schema_state(empty_url)
    assert (st.state, st.current, st.head) == ("behind", OLDER, migrate.head())
    migrate.upgrade(empty_url)
    assert migrate.schema_state(empty_url).state == "ready"
    _stamp(empty_url, "9999_from_the_future")
    st = migrate.schema_state(empty_url)
    assert st.state == "ahead"
    assert "9999_from_the_future" in st.message() and "newer release" in st.message()


def test_wait_gives_up_after_its_setting_and_says_so_meanwhile(empty_url: str) -> None:
    migrate.upgrade(empty_url, OLDER)
    now = [0.0]
    said: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s

    why = migrate.wait_for_schema(empty_url, 30, said.append, sleep=sleep, clock=lambda: now[0])
    assert why is not None and "TORCHYARD_SCHEMA_WAIT_S=30s" in why and OLDER in why
    assert said and all("waiting for `torchyard db upgrade`" in s for s in said)
    assert len(said) == 2  # at once, then every SAY_EVERY_S (15 s) of 30 s: not each poll


def test_wait_returns_once_the_upgrade_ran(empty_url: str) -> None:
    migrate.upgrade(empty_url, OLDER)
    said: list[str] = []
    polls = [0]

    def sleep(_s: float) -> None:  # the upgrade another process runs, after two polls
        polls[0] += 1
        if polls[0] == 2:
            migrate.upgrade(empty_url)

    assert migrate.wait_for_schema(empty_url, 300, said.append, sleep=sleep) is None
    assert polls[0] == 2
    assert said[-1].endswith("starting")


def test_an_unreadable_database_is_not_waited_for(tmp_path: Path) -> None:
    said: list[str] = []
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2"
    assert migrate.wait_for_schema(url, 300, said.append, sleep=lambda _: None) is None
    assert len(said) == 1 and "schema not checked" in said[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_api_waits_for_the_upgrade_then_serves(empty_url: str, tmp_path: Path) -> None:
    migrate.upgrade(empty_url, OLDER)
    port = _free_port()
    api = _torchyard("api", "--port", str(port), env=_env(empty_url, tmp_path))
    try:
        _read_until(api, "waiting for `torchyard db upgrade`")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        migrate.upgrade(empty_url)
        _read_until(api, "starting")
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the API never served after the upgrade"
            time.sleep(0.2)
    finally:
        api.terminate()
        api.communicate(timeout=30)


def test_a_service_refuses_a_newer_releases_schema_at_once(empty_url: str, tmp_path: Path) -> None:
    migrate.upgrade(empty_url)
    _stamp(empty_url, "9999_from_the_future")
    api = _torchyard("api", "--port", str(_free_port()), env=_env(empty_url, tmp_path))
    out, _ = api.communicate(timeout=60)
    assert api.returncode == 2, out
    assert "9999_from_the_future" in out and "newer release" in out


def test_the_watch_stops_the_process_once_a_newer_release_migrated(
    empty_url: str, tmp_path: Path
) -> None:
    """Another host's upgrade moves the database past this process's schema: within an
    interval it says so and stops as on SIGTERM (gracefully)."""
    migrate.upgrade(empty_url)
    port = _free_port()
    env = _env(empty_url, tmp_path, TORCHYARD_SCHEMA_WATCH_S="0.5")
    api = _torchyard("api", "--port", str(port), env=env)
    try:
        _read_until(api, "Uvicorn running")
        _stamp(empty_url, OLDER)  # a downgrade (or an older revision): not a newer release
        time.sleep(1.5)
        assert api.poll() is None
        _stamp(empty_url, "9999_from_the_future")
        out, _ = api.communicate(timeout=30)
    finally:
        if api.poll() is None:
            api.kill()
            api.communicate()
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM.
    assert api.returncode == -signal.SIGTERM, out
    assert "Application shutdown complete" in out
    assert "9999_from_the_future" in out and "Stopping, as on SIGTERM" in out


def test_the_watch_skips_reads_that_fail_and_is_off_at_zero(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert migrate.start_schema_watch(empty_url, 0, "test") is None
    stopped: list[bool] = []
    bad = "postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=1"
    t = migrate.start_schema_watch(bad, 0.05, "test", stop=lambda: stopped.append(True))
    assert t is not None
    time.sleep(0.5)
    assert t.is_alive() and not stopped  # unreadable: nothing decided, reads go on
    _stamp(empty_url, "9999_from_the_future")
    t = migrate.start_schema_watch(empty_url, 0.05, "test", stop=lambda: stopped.append(True))
    assert t is not None
    t.join(timeout=10)
    assert stopped == [True] and not t.is_alive()
