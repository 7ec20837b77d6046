"""Client fixtures: the real API (`create_app`) on a fresh SQLite store per test, reached
through a TestClient (an httpx.Client) injected into the SDK and the CLI. No worker runs, so
jobs stay queued unless a test moves them on through the store (`client_server.Store`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from client_server import Run, Store
from fastapi.testclient import TestClient
from support.db import sqlite_copy

from torchyard.api.app import create_app
from torchyard.client.cli import main
from torchyard.client.sdk import Client
from torchyard.settings import Settings


@pytest.fixture(autouse=True)
def _own_login_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every client test looks up URL and token in a login file and a TORCHYARD_HOME of its
    own, never the user's (nor a TORCHYARD_URL/TOKEN of the shell running the tests)."""
    for name in ("TORCHYARD_URL", "TORCHYARD_TOKEN", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHYARD_CONFIG", str(tmp_path / "login" / "config.json"))
    monkeypatch.setenv("TORCHYARD_HOME", str(tmp_path / "client-home"))
    return tmp_path / "login" / "config.json"


@pytest.fixture
def db_url(sqlite_template: Path, tmp_path: Path) -> Iterator[str]:
    """SQLite always (no `db_backend`): a copy of the migrated template (tests/support/db.py,
    whose `settings` stands on this)."""
    with sqlite_copy(sqlite_template, tmp_path) as url:
        yield url


@pytest.fixture
def store(db_url: str, settings: Settings) -> Store:
    return Store(db_url, settings)


@pytest.fixture
def token(store: Store) -> str:
    return store.token("alice")


@pytest.fixture
def http(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings)
    app.state.feed_poll_s = 0.02  # the event stream reads the store this often
    with TestClient(app) as c:
        yield c


@pytest.fixture
def ty(http: TestClient, token: str) -> Client:
    return Client(token=token, http=http)


@pytest.fixture
def worker(store: Store) -> Iterator[Callable[..., None]]:
    """worker(final="succeeded"): in the background, run the next job submitted (as a worker
    would), once it appears in the store."""
    threads: list[threading.Thread] = []

    def start(final: str = "succeeded", error: str | None = None) -> None:
        def work() -> None:
            deadline = time.monotonic() + 20
            while (job := store.newest_job()) is None:
                assert time.monotonic() < deadline, "no job was submitted"
                time.sleep(0.02)
            store.run(job, final, error)

        threads.append(threading.Thread(target=work, daemon=True))
        threads[-1].start()

    yield start
    for t in threads:
        t.join(20)


@pytest.fixture
def root(store: Store) -> str:
    """An admin's token."""
    return store.token("root", admin=True)


@pytest.fixture
def run(http: TestClient, root: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """run(*argv, token=…) -> (exit code, stdout, stderr); an admin's token by default.
    A test module may define its own `run` (another default token, none at all)."""

    def _run(*argv: str, token: str = root) -> tuple[int, str, str]:
        rc = main([*argv, "--token", token], http=http)
        out, err = capsys.readouterr()
        return rc, out, err

    return _run
