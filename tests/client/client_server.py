"""What the client tests need of the server side: `Store`, which writes what a worker would
(states, progress, metrics, checkpoint files) through the store's own functions; `Recorder`,
a transport around the app that records requests and breaks connections on demand; and the
test data. The fixtures that use them are in conftest.py."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from specs import synthetic_spec
from sqlalchemy import select, update
from support.db import Factory

from torchyard.settings import Settings
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job
from torchyard.store.paths import job_dir

BLOB = b"PK\x03\x04" + bytes(range(256)) * 64  # a torch.save zip, as far as the client sees
__all__ = ["BLOB", "SPEC", "STEPS", "Recorder", "Run", "Store"]
STEPS = 4
SPEC: dict[str, Any] = synthetic_spec(name="t")

Run = Callable[..., tuple[int, str, str]]
"""The `run` fixture: run(*argv, token=…) -> (exit code, stdout, stderr)."""


class Store(Factory):
    """What a worker would write, done by hand: states, progress, metrics, checkpoints."""

    def __init__(self, url: str, settings: Settings):
        super().__init__(url)
        self.settings = settings

    def progress(self, job_id: str, step: int, total: int = STEPS) -> None:
        with session_scope(self.url) as s:
            p = {"step": step, "total_steps": total, "epoch": 1, "samples_per_s": 1000.0,
                 "eta_s": float(total - step)}  # fmt: skip
            s.execute(update(Job).where(Job.id == job_id).values(progress=p))

    def metrics(self, job_id: str, steps: range) -> None:
        """train/loss = 2/step at every step, val/loss at even steps."""
        rows = [{"name": "train/loss", "step": k, "epoch": 1, "value": 2.0 / k, "time": 1.0}
                for k in steps]  # fmt: skip
        rows += [{"name": "val/loss", "step": k, "epoch": 1, "value": 2.0 / k, "time": 1.0}
                 for k in steps if k % 2 == 0]  # fmt: skip
        with session_scope(self.url) as s:
            ingest_metrics(s, job_id, rows)

    def checkpoint(self, job_id: str, data: bytes = BLOB, step: int = STEPS) -> int:
        rel = f"checkpoints/step-{step:08d}.pt"
        target = job_dir(self.settings.storage, job_id) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        with session_scope(self.url) as s:
            return record_checkpoint(
                s, job_id, attempt=1, step=step, epoch=1.0, path=rel, bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            ).id  # fmt: skip

    def run(self, job_id: str, final: str = "succeeded", error: str | None = None) -> None:
        """The whole life of a job: starting, running STEPS steps with metrics, a checkpoint,
        then `final`."""
        self.set_state(job_id, "starting")
        self.set_state(job_id, "running")
        for k in range(1, STEPS + 1):
            self.metrics(job_id, range(k, k + 1))
            self.progress(job_id, k)
        self.checkpoint(job_id)
        self.set_state(job_id, final, error=error)

    def state(self, job_id: str) -> str | None:
        with session_scope(self.url) as s:
            return s.scalar(select(Job.state).where(Job.id == job_id))

    def newest_job(self) -> str | None:
        with session_scope(self.url) as s:
            return s.scalar(select(Job.id).order_by(Job.created_at.desc()).limit(1))


class Recorder(httpx.BaseTransport):
    """The app's own transport, keeping every request; it can break the next download or
    event stream part way (once), corrupt downloads, refuse every connection, or answer
    a job's reads 503 for a while."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.requests: list[httpx.Request] = []
        self.cut_after: int | None = None  # bytes into the next download
        self.cut_events: int | None = None  # events into the next event stream
        self.corrupt = False
        self.down = False  # refuse every connection, as a stopped server does
        self.unavailable = 0  # answer the next N reads of a job 503, as a starting API does

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        path = request.url.path
        if self.unavailable and path.startswith("/v1/jobs/") and path.count("/") == 3:
            self.unavailable -= 1
            detail = {"detail": "the database is not reachable"}
            return httpx.Response(503, headers={"Retry-After": "1"}, json=detail)
        resp = self.inner.handle_request(request)
        if self.corrupt and path.endswith("/download"):
            resp.read()
            return httpx.Response(200, headers={"ETag": resp.headers["ETag"]}, content=b"evil")
        if self.cut_after is not None and path.endswith("/download"):
            broken = _Broken(resp.stream, self.cut_after, None)
            self.cut_after = None
            return httpx.Response(resp.status_code, headers=resp.headers, stream=broken)
        if self.cut_events is not None and path.endswith("/events"):
            broken = _Broken(resp.stream, None, self.cut_events)
            self.cut_events = None
            return httpx.Response(resp.status_code, headers=resp.headers, stream=broken)
        return resp


class _Broken(httpx.SyncByteStream):
    """A body that breaks off with a network error after `cut` bytes, or after `events`
    server-sent events (frames with data; `retry:` and keep-alive frames do not count),
    wherever the server's chunks happen to end."""

    def __init__(self, inner: httpx.SyncByteStream, cut: int | None, events: int | None) -> None:
        self.inner, self.cut, self.events = inner, cut, events

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._bytes() if self.events is None else self._frames()
        finally:
            self.inner.close()
        raise httpx.ReadError("connection reset by peer")

    def _bytes(self) -> Iterator[bytes]:
        sent = 0
        for chunk in self.inner:
            part = chunk[: self.cut - sent]
            sent += len(part)
            yield part
            if sent >= self.cut:
                return

    def _frames(self) -> Iterator[bytes]:
        buf, seen = b"", 0
        for chunk in self.inner:
            buf += chunk
            while m := _FRAME_END.search(buf):
                frame, buf = buf[: m.end()], buf[m.end() :]
                yield frame
                seen += b"data:" in frame
                if seen == self.events:
                    return


_FRAME_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
