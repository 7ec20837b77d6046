"""The API under ordinary faults: stalled download and event-stream clients, an exhausted
connection pool, a store outage, a swamped thread pool, a checkpoint pruned mid-request, and
a huge curve without max_points."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker
from support.db import Factory
from support.liveserver import live_server

from torchyard.api.app import SHED_WAITING_PER_THREAD, create_app
from torchyard.settings import Settings
from torchyard.store.asyncreads import AsyncReads
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import make_engine, session_scope
from torchyard.store.metrics import ingest_metrics
from torchyard.store.paths import job_dir
from torchyard.store.workers import heartbeat

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

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


def _stalled(port: int, path: str, token: str, until: bytes = b"\r\n\r\n") -> socket.socket:
    """GET `path`, read up to `until` (by default the end of the headers), then read
    nothing more: a client that stalls."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    )
    head = b""
    while until not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _stalled_download(port: int, job_id: str, token: str) -> socket.socket:
    return _stalled(port, f"/v1/jobs/{job_id}/checkpoints/latest/download", token)


def _checked_out(app: FastAPI) -> int:
    """Connections the app's engines have lent out right now."""
    pools = [f.kw["bind"].pool for f in (app.state.sessions, app.state.read_sessions)]
    return sum(p.checkedout() for p in pools)  # type: ignore[attr-defined]


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
    app = create_app(settings)
    app.state.feed_poll_s = 60.0  # after its first poll the event stream just waits
    with live_server(app) as port:
        socks = [_stalled_download(port, job, token)]
        try:
            # An event stream is open too, past its first poll (the checkpoint's event).
            socks.append(_stalled(port, f"/v1/jobs/{job}/events", token, b"event: checkpoint"))
            time.sleep(0.3)  # the server is now blocked writing the download's body
            assert _checked_out(app) == 0  # nothing held while the bodies stream
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
    with live_server(create_app(settings)) as port:
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
    import torchyard.api.routers.checkpoints as route

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


# Every route that reads the store, and the one route here that writes it.
ROUTES = [
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{job}"),
    ("GET", "/v1/jobs/{job}/metrics"),
    ("GET", "/v1/jobs/{job}/logs"),
    ("GET", "/v1/jobs/{job}/checkpoints"),
    ("GET", "/v1/jobs/{job}/checkpoints/latest/download"),
    ("GET", "/v1/jobs/{job}/events"),  # the job has ended: even a 200 would be finite
    ("GET", "/v1/workers"),
    ("POST", "/v1/jobs/{job}/cancel"),
]


def _all_503(c: TestClient, job: str, auth: dict[str, str], code: str) -> None:
    for method, route in ROUTES:
        t0 = time.monotonic()
        r = c.request(method, route.format(job=job), headers=auth)
        took = time.monotonic() - t0
        assert r.status_code == 503, (route, r.status_code, r.text)
        assert int(r.headers["retry-after"]) > 0, route
        assert set(r.json()["error"]) == {"code", "message", "details"}
        assert r.json()["error"]["code"] == code, (route, r.text)
        assert took < 2.0, (route, took)  # a fast no, never a hang


def test_pool_exhaustion_and_store_outage_are_503_with_retry_after(
    settings: Settings, factory: Factory,
) -> None:  # fmt: skip
    """A pool timeout (sqlalchemy.exc.TimeoutError) used to be a 500 after 30 s; a store
    that refuses connections (OperationalError) a 500 too. Both are a prompt 503 with
    Retry-After on every route."""
    token = factory.token("alice")
    job = factory.job("alice", state="succeeded")
    auth = {"Authorization": f"Bearer {token}"}
    app = create_app(settings.model_copy(update={"db_pool_timeout_s": 0.2}))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get(f"/v1/jobs/{job}", headers=auth).status_code == 200  # token now cached
        engines = [f.kw["bind"] for f in (app.state.sessions, app.state.read_sessions)]
        held = [e.connect() for e in engines for _ in range(e.pool.size() + e.pool._max_overflow)]
        reads = app.state.async_reads  # PostgreSQL: GET /v1/jobs/{id} reads through these
        lent = []
        if reads is not None:
            lent = [c.portal.wrap_async_context_manager(reads.connection()) for _ in range(10)]
        try:
            for cm in lent:
                cm.__enter__()
            _all_503(c, job, auth, "busy")
        finally:
            for conn in held:
                conn.close()
            for cm in lent:
                cm.__exit__(None, None, None)
        assert c.get(f"/v1/jobs/{job}", headers=auth).status_code == 200  # and it recovers

        # The store goes away: nothing listens where the database was.
        nowhere = "postgresql+psycopg://postgres@127.0.0.1:1/gone"
        gone = make_engine(nowhere, pool_timeout=0.2)
        app.state.sessions = app.state.read_sessions = sessionmaker(gone)
        if reads is not None:
            app.state.async_reads = AsyncReads(nowhere, pool_timeout=0.2)
            c.portal.call(app.state.async_reads.open)
        try:
            _all_503(c, job, auth, "unavailable")
        finally:
            if reads is not None:
                c.portal.call(app.state.async_reads.close)


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


@pytest.mark.anyio
async def test_a_swamped_thread_pool_sheds_new_requests_at_once(
    settings: Settings, factory: Factory
) -> None:
    """Every store call waits for one of TORCHYARD_API_THREADS threads. With that queue
    already full, a new request used to queue behind it without bound; it is now answered
    503 with Retry-After at once (and /healthz still answers)."""
    token = factory.token("alice")
    job = factory.job("alice")
    auth = {"Authorization": f"Bearer {token}"}
    app = create_app(settings.model_copy(update={"api_threads": 1}))
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = 1  # what the app's lifespan sets (ASGITransport runs no lifespan)
    full = SHED_WAITING_PER_THREAD * 1
    release = threading.Event()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
        async with anyio.create_task_group() as tg:
            try:
                for _ in range(1 + full):  # one holds the only thread, the rest queue
                    tg.start_soon(anyio.to_thread.run_sync, release.wait)
                with anyio.fail_after(5):
                    while limiter.statistics().tasks_waiting < full:
                        await anyio.sleep(0.01)
                with anyio.fail_after(2):  # unshed, it would wait for `release`: forever
                    r = await c.get(f"/v1/jobs/{job}", headers=auth)
                    health = await c.get("/healthz")
                assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
                assert r.json()["error"]["code"] == "busy"
                assert health.status_code == 200
            finally:
                release.set()
        # The queue has drained: requests are served again.
        with anyio.fail_after(5):
            assert (await c.get(f"/v1/jobs/{job}", headers=auth)).status_code == 200
