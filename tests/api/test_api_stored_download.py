"""Checkpoint downloads from a storage backend without local files (the in-memory one, and
real SeaweedFS through the S3 backend): streamed from the seam, with the same answers as
the local FileResponse path (Content-Length, ETag, one Range, If-Range, 304, 416, gone).
Each case runs against every backend. With TORCHYARD_DOWNLOAD_REDIRECT the API answers
with a presigned URL instead, and the SDK resumes through it."""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from support.db import Factory
from support.liveserver import live_server

import torchyard.api.routers.checkpoints as route
from torchyard.api import files
from torchyard.settings import Settings
from torchyard.storage import Storage, storage_for
from torchyard.storage.memory import MemoryStorage
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes
REL = "checkpoints/step-00000001.pt"


SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _key(storage: Storage, job: str) -> str:
    """Where the worker's upload (or the trainer, on a local storage) put the file."""
    return storage.checkpoint_key(job, REL, SHA)


_BUCKETS: dict[int, str] = {}  # the session server's bucket for this module


def _s3(request: pytest.FixtureRequest, settings: Settings, mp: pytest.MonkeyPatch) -> Storage:
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        mp.setenv(k, v)
    bucket = _BUCKETS.get(id(server)) or _BUCKETS.setdefault(id(server), server.make_bucket())
    url = f"s3://{bucket}/{uuid.uuid4().hex}"  # one bucket, a prefix per test
    s3 = settings.model_copy(update={"storage_url": url, "s3_endpoint_url": server.endpoint_url})
    return storage_for(s3)


@pytest.fixture(params=["local", "memory", "s3"])
def storage(
    request: pytest.FixtureRequest,
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Storage:
    if request.param == "local":
        return storage_for(settings)
    other = (
        MemoryStorage(tmp_path / "scratch")
        if request.param == "memory"
        else _s3(request, settings, monkeypatch)
    )
    monkeypatch.setattr(route, "storage_for", lambda _settings: other)
    return other


@pytest.fixture
def ckpt(storage: Storage, factory: Factory, db_url: str) -> tuple[str, int]:
    job = factory.job("alice", state="running")
    storage.write_bytes(_key(storage, job), PAYLOAD)
    with session_scope(db_url) as s:
        row = record_checkpoint(
            s, job, attempt=1, step=1, epoch=0.1, path=REL, bytes=len(PAYLOAD),
            sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        )  # fmt: skip
        return job, row.id


def _url(job: str, cid: int | str) -> str:
    return f"/v1/jobs/{job}/checkpoints/{cid}/download"


def test_whole_file_and_its_headers(
    client: TestClient, alice: dict[str, str], ckpt: tuple[str, int]
) -> None:
    job, cid = ckpt
    r = client.get(_url(job, cid), headers=alice)
    assert r.status_code == 200 and r.content == PAYLOAD
    assert r.headers["content-length"] == str(len(PAYLOAD))
    assert r.headers["accept-ranges"] == "bytes"
    assert r.headers["etag"] == f'"{hashlib.sha256(PAYLOAD).hexdigest()}"'
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == f'attachment; filename="{job}-step-00000001.pt"'
    assert r.headers["last-modified"]
    listed = client.get(f"/v1/jobs/{job}/checkpoints", headers=alice).json()["items"]
    assert [c["available"] for c in listed] == [True]


@pytest.mark.parametrize(
    ("range_", "status", "body", "content_range"),
    [
        ("bytes=0-0", 206, PAYLOAD[:1], "bytes 0-0/10240"),
        ("bytes=-10", 206, PAYLOAD[-10:], "bytes 10230-10239/10240"),
        ("bytes=100-199", 206, PAYLOAD[100:200], "bytes 100-199/10240"),
        ("bytes=10200-99999", 206, PAYLOAD[10200:], "bytes 10200-10239/10240"),
        ("bytes=10240-", 416, None, "bytes */10240"),
        ("bytes=-0", 416, None, "bytes */10240"),
        ("bytes=0-1,5-6", 200, PAYLOAD, None),
        ("bytes=9-3", 200, PAYLOAD, None),
        ("items=0-1", 200, PAYLOAD, None),
    ],
)
def test_ranges(
    client: TestClient,
    alice: dict[str, str],
    ckpt: tuple[str, int],
    range_: str,
    status: int,
    body: bytes | None,
    content_range: str | None,
) -> None:
    job, cid = ckpt
    r = client.get(_url(job, cid), headers=alice | {"Range": range_})
    assert r.status_code == status, r.text
    assert r.headers.get("content-range") == content_range
    if body is not None:
        assert r.content == body and r.headers["content-length"] == str(len(body))
    else:
        assert r.json()["error"]["code"] == "range_not_satisfiable"


def test_conditional_requests(
    client: TestClient, alice: dict[str, str], ckpt: tuple[str, int]
) -> None:
    job, cid = ckpt
    first = client.get(_url(job, cid), headers=alice)
    etag, modified = first.headers["etag"], first.headers["last-modified"]
    r = client.get(_url(job, cid), headers=alice | {"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag
    for validator in (etag, modified):
        resume = {"Range": "bytes=5000-", "If-Range": validator}
        r = client.get(_url(job, cid), headers=alice | resume)
        assert r.status_code == 206 and r.content == PAYLOAD[5000:]
    for stale in ('"stale"', f"W/{etag}"):
        r = client.get(_url(job, cid), headers=alice | {"Range": "bytes=5000-", "If-Range": stale})
        assert r.status_code == 200 and r.content == PAYLOAD


def test_a_file_gone_is_404_file_gone(
    client: TestClient, alice: dict[str, str], ckpt: tuple[str, int], storage: Storage
) -> None:
    job, cid = ckpt
    storage.delete(_key(storage, job))
    r = client.get(_url(job, cid), headers=alice)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_gone"
    listed = client.get(f"/v1/jobs/{job}/checkpoints", headers=alice).json()["items"]
    assert [c["available"] for c in listed] == [False]


@pytest.fixture
def redirecting(
    request: pytest.FixtureRequest, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> Storage:
    s3 = _s3(request, settings, monkeypatch)
    monkeypatch.setattr(route, "storage_for", lambda _settings: s3)
    monkeypatch.setattr(settings, "download_redirect", True)
    return s3


def test_a_redirect_goes_to_the_store_and_the_sdk_resumes_through_it(
    redirecting: Storage,
    app: Any,
    client: TestClient,
    alice: dict[str, str],
    factory: Factory,
    db_url: str,
    tmp_path: Path,
) -> None:
    from torchyard.client.sdk import Client

    job = factory.job("alice", state="running")
    redirecting.write_bytes(_key(redirecting, job), PAYLOAD)
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    with session_scope(db_url) as s:
        cid = record_checkpoint(s, job, attempt=1, step=1, epoch=0.1, path=REL,
                                bytes=len(PAYLOAD), sha256=sha).id  # fmt: skip
    r = client.get(_url(job, cid), headers=alice, follow_redirects=False)
    assert r.status_code == 307 and r.headers["etag"] == f'"{sha}"'
    location = r.headers["location"]
    assert location.startswith(redirecting.presign(_key(redirecting, job), 60)[:40])  # type: ignore[index]
    # The stored name carries the sha256; the file is saved under its own name.
    saved = httpx.get(location, headers={"Range": "bytes=0-0"}).headers["content-disposition"]
    assert saved == f'attachment; filename="{job}-step-00000001.pt"'
    # Someone else's checkpoint: no redirect, no URL.
    other = factory.job("bob", state="running")
    assert client.get(_url(other, cid), headers=alice, follow_redirects=False).status_code == 404
    # The SDK follows it without its token and resumes a broken download with Range.
    part = tmp_path / "w.pt.part"
    part.write_bytes(PAYLOAD[:4000])
    with live_server(app) as port:  # a real HTTP client (TestClient follows redirects)
        sdk = Client(f"http://127.0.0.1:{port}", token=alice["Authorization"].split()[1])
        got = sdk.download(job, cid, tmp_path / "w.pt")
    assert got.path.read_bytes() == PAYLOAD and got.sha256 == sha and got.resumed_from == 4000


class _Stream(io.RawIOBase):
    """A store's body: `blocks` blocks of 1 MiB, counted as read; fails at `fail_at`."""

    def __init__(self, blocks: int, fail_at: int | None = None) -> None:
        self.left, self.reads, self.fail_at = blocks, 0, fail_at

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.reads == self.fail_at:
            raise OSError("the store went away")
        if self.left == 0:
            return b""
        self.left, self.reads = self.left - 1, self.reads + 1
        return bytes([self.reads % 256]) * (1 << 20)


def _collect(stream: _Stream, length: int, take: int | None = None) -> list[bytes]:
    async def go() -> list[bytes]:
        got: list[bytes] = []
        gen = files._read_ahead(stream, length)  # type: ignore[arg-type]
        try:
            async for block in gen:
                got.append(block)
                if take is not None and len(got) == take:
                    break
        finally:
            await gen.aclose()
        return got

    return asyncio.run(go())


def test_read_ahead_sends_every_block_in_order_and_closes_the_store_body() -> None:
    s = _Stream(10)
    got = _collect(s, 10 << 20)
    assert [b[0] for b in got] == list(range(1, 11)) and s.closed


def test_a_client_gone_stops_the_reads_within_the_read_ahead() -> None:
    s = _Stream(1000)
    assert len(_collect(s, 1000 << 20, take=2)) == 2
    deadline = time.monotonic() + 5
    while not s.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.closed and s.reads <= 2 + files.READ_AHEAD + 1  # not the 1000 blocks
    assert not [t for t in threading.enumerate() if t.name == "download-read-ahead"]


def test_a_store_failing_mid_stream_cuts_the_response_after_what_was_read() -> None:
    s = _Stream(10, fail_at=3)
    with pytest.raises(OSError, match="the store went away"):
        _collect(s, 10 << 20)
    assert s.closed
