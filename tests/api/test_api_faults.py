"""The API under ordinary faults: a stalled download client, an exhausted connection pool,
a store outage, a checkpoint pruned mid-request, and a huge curve without max_points."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker
from torchyard_testdb import Factory

from api.app import create_app
from store.checkpoints import record_checkpoint
from store.db import make_engine, session_scope
from store.metrics import ingest_metrics
from store.paths import job_dir
from store.settings import Settings
from store.workers import heartbeat

BIG = 16 * 1024 * 1024  # far more than loopback socket buffers: the server must block


def _checkpoint(settings: Settings, db_url: str, job_id: str, size: int) -> str:
    rel = "checkpoints/step-00000001.pt"
    path = job_dir(settings.storage, job_id) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    data = bytes(range(256)) * (size // 256)
    path.write_bytes(data)
    with session_scope(db_url) as s:
        record_checkpoint(s, job_id, attempt=1, step=1, epoch=0.0, path=rel, bytes=len(data),
                          sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
    return rel


@contextlib.contextmanager
def _server(settings: Settings) -> Iterator[int]:
    """The real app under uvicorn on a free port, in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        t.join(timeout=10)


def _stalled_download(port: int, job_id: str, token: str) -> socket.socket:
    """Ask for the checkpoint, read the status line and headers, then read nothing more."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        f"GET /v1/jobs/{job_id}/checkpoints/latest/download HTTP/1.1\r\nHost: t\r\n"
        f"Authorization: Bearer {token}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def test_a_stalled_download_blocks_no_writer_and_no_reader(
    settings: Settings, db_url: str, factory: Factory
) -> None:
    """SQLite: every transaction used to BEGIN IMMEDIATE and the download's session stayed
    open until the last byte was sent, so one stalled client made heartbeats fail with
    "database is locked" after 30 s. Now nothing is held while the body streams."""
    token = factory.token("alice")
    job = factory.job("alice", state="running")
    factory.worker("w1")
    _checkpoint(settings, db_url, job, BIG)
    with _server(settings) as port:
        socks = [_stalled_download(port, job, token)]
        try:
            time.sleep(0.3)  # the server is now blocked writing the body
            t0 = time.monotonic()
            with session_scope(db_url) as s:  # a worker's heartbeat: a write transaction
                assert heartbeat(s, "w1") is not None
            assert time.monotonic() - t0 < 1.0
            r = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job}",
                          headers={"Authorization": f"Bearer {token}"}, timeout=5)  # fmt: skip
            assert r.status_code == 200
        finally:
            for s in socks:
                s.close()


def test_more_stalled_downloads_than_the_pool_leave_every_route_working(
    settings: Settings, db_url: str, factory: Factory
) -> None:
    """31 stalled downloads used to hold the whole pool (on PostgreSQL 10 + 20 overflow,
    "idle in transaction"), and every other route answered 500."""
    token = factory.token("alice")
    job = factory.job("alice", state="running")
    _checkpoint(settings, db_url, job, BIG)
    auth = {"Authorization": f"Bearer {token}"}
    with _server(settings) as port:
        socks = []
        try:
            for _ in range(32):
                socks.append(_stalled_download(port, job, token))
            base = f"http://127.0.0.1:{port}"
            for path in (f"/v1/jobs/{job}", "/v1/jobs", f"/v1/jobs/{job}/checkpoints", "/readyz"):
                r = httpx.get(base + path, headers=auth, timeout=5)
                assert r.status_code == 200, (path, r.text)
        finally:
            for s in socks:
                s.close()


def test_a_checkpoint_pruned_before_it_is_opened_is_a_404(
    client: TestClient, settings: Settings, db_url: str, factory: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """keep_last may delete a file between the existence check and open(): that used to be
    a 500; it is the same 404 `file_gone` as a file already gone."""
    import api.routers.checkpoints as route

    token = factory.token("alice")
    job = factory.job("alice", state="running")
    rel = _checkpoint(settings, db_url, job, 1024)
    real = route.checkpoint_file

    def check_then_prune(storage: Path, row: Any) -> Path:
        path = real(storage, row)
        path.unlink()  # the trainer's keep_last, right after the check
        return path

    monkeypatch.setattr(route, "checkpoint_file", check_then_prune)
    r = client.get(f"/v1/jobs/{job}/checkpoints/latest/download",
                   headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "file_gone"
    assert rel


def test_pool_exhaustion_and_store_outage_are_503_with_retry_after(
    settings: Settings, factory: Factory,
) -> None:  # fmt: skip
    token = factory.token("alice")
    job = factory.job("alice")
    auth = {"Authorization": f"Bearer {token}"}
    app = create_app(settings.model_copy(update={"db_pool_timeout_s": 0.2}))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get(f"/v1/jobs/{job}/checkpoints", headers=auth).status_code == 200
        engine = app.state.read_sessions.kw["bind"]
        held = [
            engine.connect() for _ in range(engine.pool.size() + max(engine.pool._max_overflow, 0))
        ]
        try:
            t0 = time.monotonic()
            r = c.get(f"/v1/jobs/{job}/checkpoints", headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["code"] == "busy"
            assert time.monotonic() - t0 < 2.0  # fast, not a hang
        finally:
            for conn in held:
                conn.close()

        # The store goes away: nothing listens where the database was.
        app.state.read_sessions = sessionmaker(
            make_engine("postgresql+psycopg://postgres@127.0.0.1:1/gone", pool_timeout=0.2)
        )
        r = c.get(f"/v1/jobs/{job}/checkpoints", headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert r.json()["error"]["code"] == "unavailable"


def test_metrics_without_max_points_come_in_pages(
    settings: Settings, db_url: str, factory: Factory
) -> None:
    """Without max_points every point of a series used to come back in one response.
    Pages of at most TORCHYARD_METRICS_PAGE_POINTS per curve, followed with after_step,
    return each point exactly once."""
    token = factory.token("alice")
    job = factory.job("alice", state="running")
    loss = [{"name": "train/loss", "step": i, "epoch": 0.0, "value": float(i), "time": 0.0}
            for i in range(1, 351)]  # fmt: skip
    acc = [{"name": "val/accuracy", "step": i, "epoch": 0.0, "value": 0.5, "time": 0.0}
           for i in range(10, 351, 10)]  # fmt: skip
    with session_scope(db_url) as s:
        ingest_metrics(s, job, loss + acc)
    app = create_app(settings.model_copy(update={"metrics_page_points": 100}))
    seen: dict[str, list[int]] = {"train/loss": [], "val/accuracy": []}
    pages = 0
    with TestClient(app) as c:
        after = None
        while True:
            params = {} if after is None else {"after_step": after}
            body = c.get(f"/v1/jobs/{job}/metrics", params=params,
                         headers={"Authorization": f"Bearer {token}"}).json()  # fmt: skip
            pages += 1
            for name, series in body["series"].items():
                assert len(series["steps"]) <= 100
                seen[name] += series["steps"]
            after = body.get("next_after_step")
            if after is None:
                break
    assert seen["train/loss"] == list(range(1, 351))
    assert seen["val/accuracy"] == list(range(10, 351, 10))
    assert pages == 4
