"""N followers of one running job over real HTTP, and what they cost the store: the
measurement the SSE fan-out's test (tests/api/test_api_fanout.py) and its benchmark
(bench/follow_bench.py, which prints it at scale) share, so both measure one thing.

`measure` serves the app with uvicorn in a thread of this process on a free loopback port,
attaches the followers to `GET /v1/jobs/{id}/events` (raw asyncio streams: little client
CPU), writes one metric point `rate` times a second for `seconds`, ends the job, and waits
for every stream's `end` event. The server's read engine counts its SQL statements
(SQLAlchemy `before_cursor_execute`); a feed poll is one statement on the metrics table."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from specs import synthetic_spec
from sqlalchemy import event

from torchyard.store.auth import create_token, get_or_create_user
from torchyard.store.db import session_scope
from torchyard.store.jobs import create_job
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job
from torchyard.store.states import RUNNING, STARTING, SUCCEEDED, transition

RETRIES: list[int] = []  # connects shed with 503 and retried


@dataclass
class StatementCounter:
    """SQL statements on one engine: in all, feed polls (one metrics SELECT each), and
    open streams' re-checks (each stream every RECHECK_S: that the job is still theirs to
    see, a jobs row; that their token still stands, a users row once the token cache's
    entry is older than TOKEN_CACHE_TTL_S; each after a BEGIN on SQLite): a per-follower
    cost by design, counted apart from the poller's."""

    total: int = 0
    polls: int = 0
    rechecks: int = 0  # re-checks' statements, their BEGINs included
    _begun: set[int] = field(default_factory=set)  # connections whose last statement: BEGIN

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.total += 1
        head = statement.lstrip().upper()
        begun = id(conn) in self._begun
        self._begun.discard(id(conn))
        if head.startswith("BEGIN"):
            self._begun.add(id(conn))
        elif head.startswith("SELECT") and "FROM metrics" in statement:
            self.polls += 1
        elif head.startswith(("SELECT JOBS.ID, JOBS.OWNER_ID", "SELECT USERS.")):
            self.rechecks += 2 if begun else 1


@dataclass
class FollowResult:
    followers: int
    fed: int
    received: list[dict[str, int]]  # per follower: count per event name
    sequences: int  # distinct id sequences among followers (1: all saw the same stream)
    ticks: int  # poller iterations while streaming
    polls: int  # store polls (poller's and followers' own) while streaming
    statements: int  # SQL statements on the read engine while streaming, re-checks included
    rechecks: int  # of those, the open streams' re-checks' (visibility, token: StatementCounter)
    connect_statements: int  # SQL statements while the followers connected
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve(app: FastAPI) -> Iterator[int]:
    """The app under uvicorn in a thread (its own event loop) on a free port."""
    sock = free_socket()
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", backlog=4096, timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    out, i = bytearray(), 0
    while True:
        j = raw.index(b"\r\n", i)
        size = int(raw[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += raw[j + 2 : j + 2 + size]
        i = j + 2 + size + 2


def parse_events(body: bytes) -> list[tuple[str, str]]:
    """(event, id) of each SSE event in `body`."""
    out = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            out.append((fields["event"], fields.get("id", "")))
    return out


async def _connect(port: int, path: str, token: str) -> tuple[asyncio.StreamReader, Any]:
    """An open event stream; a 503 (the server sheds a burst of connects) is retried
    after its Retry-After, as an EventSource would."""
    for _ in range(60):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n"
            "Accept: text/event-stream\r\nConnection: close\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 200"):
            return reader, writer
        writer.close()
        if not head.startswith(b"HTTP/1.1 503"):
            raise RuntimeError(f"follower refused: {head[:200]!r}")
        RETRIES.append(1)
        await asyncio.sleep(1 + random.random())
    raise RuntimeError("follower still shed after 60 tries")


async def follower(port: int, path: str, token: str, attached: Callable[[], None]) -> bytes:
    """One SSE client: the body it received, once the server ended the stream."""
    reader, writer = await _connect(port, path, token)
    first = await reader.read(65536)  # the stream's `retry:` preamble: attached
    attached()
    rest = await reader.read()
    writer.close()
    return _dechunk(first + rest)


def feed(db_url: str, job_id: str, rate: float, seconds: float) -> int:
    """What a trainer writes: one metric point each 1/rate s, then the job succeeds."""
    n = max(1, int(rate * seconds))
    t0 = time.monotonic()
    for k in range(n):
        with session_scope(db_url) as s:
            point = {"name": "train/loss", "step": k, "epoch": k / n, "value": 1 / (k + 1)}
            ingest_metrics(s, job_id, [{**point, "time": time.time()}])
        time.sleep(max(0.0, t0 + (k + 1) / rate - time.monotonic()))
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        transition(s, job, SUCCEEDED, reason="bench")
    return n


def make_job(db_url: str) -> tuple[str, str]:
    """(a running job, its owner's token)."""
    with session_scope(db_url) as s:
        token = create_token(s, "bench")
        uid = get_or_create_user(s, "bench").id
        job, _ = create_job(s, uid, synthetic_spec(), name="follow-bench")
        for to in (STARTING, RUNNING):
            transition(s, job, to, reason="bench")
        return job.id, token


async def _follow_all(
    port: int, job_id: str, token: str, n: int, on_attached: Callable[[], None]
) -> tuple[list[asyncio.Task[bytes]], asyncio.Event]:
    ready = asyncio.Event()
    count = 0

    def attached() -> None:
        nonlocal count
        count += 1
        if count == n:
            ready.set()
            on_attached()

    path = f"/v1/jobs/{job_id}/events"
    tasks = [asyncio.create_task(follower(port, path, token, attached)) for _ in range(n)]
    return tasks, ready


async def measure(
    app: FastAPI, db_url: str, followers: int, rate: float, seconds: float
) -> FollowResult:
    """Attach `followers` to a running job, feed it, end it; what each follower saw."""
    job_id, token = make_job(db_url)
    counter = StatementCounter()
    hub = app.state.feed_hub
    marks: dict[str, Any] = {}
    with serve(app) as port:
        engine = app.state.read_sessions.kw["bind"].engine
        event.listen(engine, "before_cursor_execute", counter)
        try:
            t0 = time.monotonic()
            tasks, ready = await _follow_all(
                port, job_id, token, followers,
                lambda: marks.update(
                    c=counter.total, p=counter.polls, r=counter.rechecks, h=hub.polls
                ),
            )  # fmt: skip
            await asyncio.wait_for(ready.wait(), 120)
            connect_s = time.monotonic() - t0
            t1 = time.monotonic()
            fed = await asyncio.to_thread(feed, db_url, job_id, rate, seconds)
            bodies = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            elapsed = time.monotonic() - t1
        finally:
            event.remove(engine, "before_cursor_execute", counter)
    streams = [parse_events(b) for b in bodies]
    received = []
    for s in streams:
        counts: dict[str, int] = {}
        for name, _ in s:
            counts[name] = counts.get(name, 0) + 1
        received.append(counts)
    return FollowResult(
        followers=followers,
        fed=fed,
        received=received,
        sequences=len({tuple(i for _, i in s) for s in streams}),
        ticks=hub.polls - marks["h"],
        polls=counter.polls - marks["p"],
        statements=counter.total - marks["c"],
        rechecks=counter.rechecks - marks["r"],
        connect_statements=marks["c"],
        seconds=elapsed,
        extra={"connect_s": connect_s, "connect_polls": marks["h"], "shed": len(RETRIES)},
    )
