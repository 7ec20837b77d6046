"""What the S3 backend promises beyond the contract, against a real SeaweedFS (tests/
seaweed.py, one server for the session, each test under a fresh prefix): multipart uploads
checked end to end, appended objects as pieces (compaction included), another host reading
what one wrote, the host cache of `local_copy`, the start-up check, and presigned URLs."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from seaweed import Seaweed

from torchyard.settings import Settings
from torchyard.storage import UnsafePath, job_key, open_storage
from torchyard.storage.base import (
    ChecksumMismatch,
    StorageConfigError,
    StorageUnavailable,
)
from torchyard.storage.pieces import COMPACT_EVERY, PIECES
from torchyard.storage.s3 import S3Storage

JOB = "d" * 32
MiB = 1 << 20
Make = Callable[..., S3Storage]


@pytest.fixture(scope="module")
def bucket(s3_server: Seaweed) -> str:
    return s3_server.make_bucket()


@pytest.fixture(autouse=True)
def _credentials(s3_server: Seaweed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's identity through boto3's standard chain, as in production."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def make(s3_server: Seaweed, bucket: str, tmp_path: Path) -> Make:
    """`make(cache="a")`: an S3Storage on this test's own prefix (one per "host": each
    `cache` name its own cache folder), 5 MiB parts."""
    prefix = f"s3test/{uuid.uuid4().hex}"

    def make(cache: str = "host-a", **kw: Any) -> S3Storage:
        kw.setdefault("part_bytes", 5 * MiB)
        kw.setdefault("concurrency", 4)
        return S3Storage(bucket, kw.pop("prefix", prefix), cache=tmp_path / cache,
                         endpoint_url=kw.pop("endpoint_url", s3_server.endpoint_url), **kw)  # fmt: skip

    return make


def _names(server: Seaweed, bucket: str, prefix: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2")
    return [o["Key"] for p in pages.paginate(Bucket=bucket, Prefix=prefix) for o in p.get("Contents", [])]  # fmt: skip


def _blob(n: int, seed: int = 1) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


# ---------------------------------------------------------------- multipart


def test_a_multipart_file_round_trips_with_its_sha256(
    make: Make, s3_server: Seaweed, bucket: str, tmp_path: Path
) -> None:
    s = make()
    data = os.urandom(12 * MiB + 12345)
    sha = hashlib.sha256(data).hexdigest()
    src = tmp_path / "ckpt.pt"
    src.write_bytes(data)
    key = job_key(JOB, "checkpoints/step-1.pt")
    info = s.write_file(key, src)  # no sha256 given: hashed first
    assert (info.key, info.size, info.sha256) == (key, len(data), sha)
    head = s3_server.client().head_object(Bucket=bucket, Key=f"{s.prefix}/{key}")
    assert head["Metadata"]["sha256"] == sha and head["ETag"].strip('"').endswith("-3")
    assert s.stat(key).sha256 == sha and s.stat(key).size == len(data)
    with s.open_read(key) as f:
        assert hashlib.sha256(f.read()).hexdigest() == sha
    edge = 5 * MiB
    assert s.read_range(key, edge - 7, 20) == (data[edge - 7 : edge + 13], len(data))
    with s.open_read(key, edge - 3, 2 * MiB) as f:
        assert f.read() == data[edge - 3 : edge - 3 + 2 * MiB]
    # From memory and from a stream (spooled) the same way, with the given sha256 checked.
    assert s.write_bytes(key + ".b", data).sha256 == sha
    with open(src, "rb") as f:
        assert s.write_stream(key + ".c", f).sha256 == sha
    assert s.stat(key + ".c").sha256 == sha and s.read_range(key + ".c", 0, 9)[0] == data[:9]
    assert s.write_file(key + ".d", src, move=True, sha256=sha).sha256 == sha
    assert not src.exists() and s.stat(key + ".d").size == len(data)


def test_a_wrong_sha256_stores_nothing_and_leaves_no_upload(
    make: Make, s3_server: Seaweed, bucket: str, tmp_path: Path
) -> None:
    s = make()
    key = job_key(JOB, "checkpoints/bad.pt")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * MiB))
    with pytest.raises(ChecksumMismatch):
        s.write_file(key, src, sha256="0" * 64)
    assert not s.exists(key)
    uploads = s3_server.client().list_multipart_uploads(Bucket=bucket, Prefix=s.prefix)
    assert uploads.get("Uploads", []) == []
    # A small one is refused before anything goes up; an old object stays as it was.
    s.write_bytes(key, b"old")
    small = tmp_path / "small.bin"
    small.write_bytes(b"new bytes")
    with pytest.raises(ChecksumMismatch):
        s.write_file(key, small, sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(ChecksumMismatch):
        s.write_file(key, src, sha256=hashlib.sha256(b"other").hexdigest(), move=True)
    assert src.exists() and s.read_range(key, 0, 10) == (b"old", 3)


# ---------------------------------------------------------------- appended objects


def _check_reads(s: S3Storage, key: str, expected: bytes, bounds: list[int]) -> None:
    assert s.stat(key).size == len(expected)
    some = bounds[:: max(1, len(bounds) // 12)]  # piece boundaries, and a byte inside
    for at in {0, 1, *some, *(b - 1 for b in some if b), len(expected) - 1}:
        assert s.read_range(key, at, 37) == (expected[at : at + 37], len(expected)), at
    with s.open_read(key, 3) as f:
        assert f.read() == expected[3:]


def test_appends_read_back_as_one_object_through_compaction(
    make: Make, s3_server: Seaweed, bucket: str
) -> None:
    s = make()
    key = job_key(JOB, "output.log")
    tail = s.open_tail(key, 0)
    assert tail.read() == b""
    expected, bounds = b"", []
    for i in range(COMPACT_EVERY + 40):
        chunk = f"line {i} ".encode() * (1 + i % 7) + b"\n"
        s.append(key, chunk)
        bounds.append(len(expected))
        expected += chunk
        if i in (0, 5, 99):
            _check_reads(s, key, expected, bounds)
    assert tail.read() == expected and tail.read() == b""
    s.append(key, b"more\n")
    expected += b"more\n"
    assert tail.read() == b"more\n"
    _check_reads(s, key, expected, bounds)
    pieces = [n for n in _names(s3_server, bucket, s.prefix) if PIECES in n]
    assert 1 <= len(pieces) <= COMPACT_EVERY and len(pieces) < len(bounds) // 2, "compacted"
    assert [(o.key, o.size) for o in s.list(f"jobs/{JOB}")] == [(key, len(expected))]
    assert s.local_copy(key).read_bytes() == expected
    assert s.delete(key) is True and not s.exists(key)
    assert _names(s3_server, bucket, s.prefix) == []
    assert s.delete(key) is False


def test_readers_stay_right_while_the_appender_compacts(make: Make) -> None:
    writer, reader = make("host-a"), make("host-b")
    key = job_key(JOB, "events.jsonl")
    chunks = [f'{{"step": {i}}}\n'.encode() * 40 for i in range(COMPACT_EVERY + 20)]
    expected = b"".join(chunks)
    done = threading.Event()
    errors: list[BaseException] = []

    def append() -> None:
        try:
            for c in chunks:
                writer.append(key, c)
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=append, daemon=True).start()
    reads = 0
    while not done.is_set() or reads < 3:
        try:
            data, size = reader.read_range(key, 0, len(expected))
        except FileNotFoundError:
            continue  # no first piece yet
        assert data == expected[:size], "a read is always a prefix of what was appended"
        reads += 1
    assert not errors, errors
    assert reader.read_range(key, 0, len(expected)) == (expected, len(expected))
    assert reads > 5


def test_another_host_reads_what_one_wrote_and_appended(make: Make, tmp_path: Path) -> None:
    a, b = make("host-a"), make("host-b")
    log = job_key(JOB, "output.log")
    ckpt = job_key(JOB, "checkpoints/step-2.pt")
    a.append(log, b"hello ")
    a.append(log, b"world\n")
    a.write_bytes(ckpt, b"weights" * 1000)
    tail = b.open_tail(log, 6)
    assert tail.read() == b"world\n"
    assert b.read_range(log, 0, 100) == (b"hello world\n", 12)
    copy = b.local_copy(ckpt, sha256=hashlib.sha256(b"weights" * 1000).hexdigest())
    assert copy == tmp_path / "host-b" / ckpt and copy.read_bytes() == b"weights" * 1000
    assert copy.parent.parent == b.run_dir(JOB)
    a.append(log, b"again\n")
    assert tail.read() == b"again\n"
    # A whole write replaces the pieces; an append after it goes on from its end.
    a.write_bytes(log, b"fresh\n")
    assert b.read_range(log, 0, 100) == (b"fresh\n", 6)
    b.append(log, b"next\n")  # b is the appender now (one at a time)
    assert a.read_range(log, 0, 100) == (b"fresh\nnext\n", 11)
    assert [o.key for o in a.list("")] == sorted([ckpt, log])


# ---------------------------------------------------------------- the host cache


def test_local_copy_fetches_verifies_and_refetches_a_tampered_copy(make: Make) -> None:
    s = make()
    key = job_key(JOB, "checkpoints/step-3.pt")
    data = os.urandom(11 * MiB)  # three ranges of 5 MiB at once
    sha = s.write_bytes(key, data).sha256
    assert sha == hashlib.sha256(data).hexdigest()
    path = s.local_copy(key)
    assert path == s.cache.root / key and path.read_bytes() == data
    assert s.local_copy(key, sha256=sha) == path  # the cached copy, checked
    path.write_bytes(b"\0" * len(data))  # same size, other bytes
    assert s.local_copy(key, sha256=sha).read_bytes() == data
    with pytest.raises(ChecksumMismatch):
        s.local_copy(key, sha256="f" * 64)
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"
    path.unlink()
    with pytest.raises(ChecksumMismatch):
        s.local_copy(key, sha256="f" * 64)
    assert list(path.parent.iterdir()) == [], "a copy that does not match is not kept"


def test_local_copy_never_follows_a_link_in_the_cache(make: Make, tmp_path: Path) -> None:
    s = make()
    key = job_key(JOB, "checkpoints/step-4.pt")
    s.write_bytes(key, b"the real checkpoint")
    secret = tmp_path / "secret"
    secret.write_bytes(b"the host's file")
    planted = s.cache.root / key
    planted.parent.mkdir(parents=True)
    planted.symlink_to(secret)
    got = s.local_copy(key)
    assert got == planted and not got.is_symlink() and got.read_bytes() == b"the real checkpoint"
    assert secret.read_bytes() == b"the host's file"
    other = job_key(JOB, "elsewhere/step-5.pt")
    s.write_bytes(other, b"x")
    (s.run_dir(JOB) / "elsewhere").symlink_to(tmp_path)
    with pytest.raises(UnsafePath):
        s.local_copy(other)
    assert not (tmp_path / "step-5.pt").exists()


# ---------------------------------------------------------------- start-up check and errors


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_check_names_the_setting_to_fix(
    make: Make, s3_server: Seaweed, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = make()
    good.check()
    assert list(good.list("")) == [], "the probe is removed and never listed"
    missing = S3Storage("no-such-bucket-here", cache=good.cache.root,
                        endpoint_url=s3_server.endpoint_url)  # fmt: skip
    url = f"http://127.0.0.1:{_closed_port()}"
    unreachable = make(endpoint_url=url)
    for storage, words in [
        (missing, ["TORCHYARD_STORAGE_URL", "no-such-bucket-here"]),
        (unreachable, ["TORCHYARD_S3_ENDPOINT_URL", url]),
    ]:
        started = time.monotonic()
        with pytest.raises(StorageConfigError) as got:
            storage.check()
        assert all(w in str(got.value) for w in words), got.value
        assert time.monotonic() - started < 10
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    started = time.monotonic()
    with pytest.raises(StorageConfigError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        make().check()
    assert time.monotonic() - started < 10


def test_run_time_errors_are_the_storages_own(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make()
    for reserved in ("x.log.pieces/0000000000000000-0000000000000001", ".torchyard-probe/x"):
        with pytest.raises(UnsafePath):
            s.write_bytes(reserved, b"x")
    down = make(endpoint_url=f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(StorageUnavailable, match=r"127\.0\.0\.1"):
        down.stat("a/b")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionError):
        make().write_bytes("a/b", b"x")


def test_from_url_reads_the_settings_without_touching_the_network(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "cache",
                        storage_url="s3://bkt/some/prefix",
                        s3_endpoint_url=f"http://127.0.0.1:{_closed_port()}",
                        s3_part_bytes=6 * MiB, s3_concurrency=3)  # fmt: skip
    s = open_storage(settings.storage_url or "", settings)
    assert isinstance(s, S3Storage) and (s.bucket, s.prefix) == ("bkt", "some/prefix")
    assert (s.part_bytes, s.concurrency) == (6 * MiB, 3) and s._client_obj is None
    assert s.describe("jobs/x") == "s3://bkt/some/prefix/jobs/x"
    assert s.run_dir(JOB) == (tmp_path / "cache" / "jobs" / JOB).resolve()
    assert s.local_path("jobs/x") is None and not s.stored_run_dirs
    assert s.staging_dir("bundles").is_dir()


# ---------------------------------------------------------------- presigned URLs


def test_a_presigned_url_serves_ranges(make: Make) -> None:
    s = make()
    key = job_key(JOB, "checkpoints/step-6.pt")
    data = _blob(300_000)
    s.write_bytes(key, data)
    url = s.presign(key, 60)
    assert url is not None and url.startswith(str(s.endpoint_url))
    r = httpx.get(url, headers={"Range": "bytes=1000-1999"})
    assert r.status_code == 206 and r.content == data[1000:2000]
    assert httpx.get(url).content == data
    s.write_bytes(key + ".other", b"secret")
    assert httpx.get(url.replace("step-6.pt", "step-6.pt.other")).status_code == 403
