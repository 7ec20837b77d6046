"""The storage seam's contract: the same assertions against every backend (the local file
system, the in-memory one and S3 on a real SeaweedFS, each test under a fresh prefix of one
bucket), so a new backend is added to BACKENDS here and must pass them unchanged. Local-only promises (symlinks, atomic renames, the run
directory's place) are in test_storage_local.py."""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from seaweed import Seaweed

from torchyard.settings import Settings
from torchyard.storage import (
    Storage,
    UnsafePath,
    backend_class,
    check_key,
    job_key,
    open_storage,
    run_dir,
    storage_for,
)
from torchyard.storage.local import LocalStorage
from torchyard.storage.memory import MemoryStorage
from torchyard.storage.s3 import S3Storage

JOB = "a" * 32
KEY = f"jobs/{JOB}/checkpoints/step-00000010.pt"
DATA = bytes(range(256)) * 64  # 16 KiB


def _s3(tmp: Path, request: pytest.FixtureRequest) -> Storage:
    """A fresh prefix of the session's bucket on the real SeaweedFS (tests/seaweed.py),
    credentials through boto3's standard chain as in production; 5 MiB parts."""
    server = request.getfixturevalue("s3_server")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    bucket = request.getfixturevalue("s3_bucket")
    prefix = f"contract/{uuid.uuid4().hex}"
    return S3Storage(bucket, prefix, cache=tmp / "cache", endpoint_url=server.endpoint_url,
                     part_bytes=5 << 20, concurrency=4)  # fmt: skip


BACKENDS: dict[str, Callable[[Path, pytest.FixtureRequest], Storage]] = {
    "local": lambda tmp, _: LocalStorage(tmp / "root"),
    "memory": lambda tmp, _: MemoryStorage(tmp / "scratch"),
    "s3": _s3,
}


@pytest.fixture(scope="session")
def s3_bucket(s3_server: Seaweed) -> str:
    return s3_server.make_bucket()


@pytest.fixture(params=sorted(BACKENDS))
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return BACKENDS[request.param](tmp_path, request)


def test_write_then_stat_read_and_ranges(storage: Storage) -> None:
    info = storage.write_bytes(KEY, DATA)
    assert (info.key, info.size) == (KEY, len(DATA)) and info.mtime > 0
    st = storage.stat(KEY)
    assert st.size == len(DATA) and st.sha256 in (None, hashlib.sha256(DATA).hexdigest())
    assert storage.exists(KEY)
    with storage.open_read(KEY) as f:
        assert f.read() == DATA
    with storage.open_read(KEY, 100) as f:
        assert f.read() == DATA[100:]
    with storage.open_read(KEY, 100, 50) as f:
        assert f.read(10) == DATA[100:110] and f.read() == DATA[110:150] and f.read() == b""
    with storage.open_read(KEY, len(DATA) - 5, 100) as f:
        assert f.read() == DATA[-5:]
    assert storage.read_range(KEY, 0, 10) == (DATA[:10], len(DATA))
    assert storage.read_range(KEY, len(DATA) - 3, 10) == (DATA[-3:], len(DATA))
    assert storage.read_range(KEY, len(DATA) + 7, 10) == (b"", len(DATA))


def test_missing_objects_are_file_not_found(storage: Storage) -> None:
    missing = job_key(JOB, "nothing.pt")
    assert not storage.exists(missing)
    for call in (
        lambda: storage.stat(missing),
        lambda: storage.open_read(missing),
        lambda: storage.read_range(missing, 0, 1),
        lambda: storage.local_copy(missing),
    ):
        with pytest.raises(FileNotFoundError):
            call()
    assert storage.delete(missing) is False


def test_writes_replace_whole_objects(storage: Storage, tmp_path: Path) -> None:
    storage.write_bytes(KEY, DATA)
    storage.write_stream(KEY, io.BytesIO(b"second"))
    assert storage.read_range(KEY, 0, 100) == (b"second", 6)
    src = tmp_path / "upload.bin"
    src.write_bytes(b"from a file")
    storage.write_file(KEY, src)
    assert src.exists() and storage.read_range(KEY, 0, 100)[0] == b"from a file"
    src.write_bytes(b"moved in")
    storage.write_file(KEY, src, move=True)
    assert not src.exists() and storage.read_range(KEY, 0, 100)[0] == b"moved in"


def test_append_and_tail(storage: Storage) -> None:
    key = job_key(JOB, "events.jsonl")
    tail = storage.open_tail(key, 0)
    assert tail.read() == b""  # not there yet: a later read finds it
    storage.append(key, b"one\n")
    storage.append(key, b"two\n")
    assert tail.read() == b"one\ntwo\n"
    assert tail.read() == b""
    storage.append(key, b"three")
    assert tail.read() == b"three"
    tail.close()
    late = storage.open_tail(key, 4)
    assert late.read() == b"two\nthree"
    late.close()
    assert storage.read_range(key, 0, 100) == (b"one\ntwo\nthree", 13)


def test_list_under_a_prefix_and_delete(storage: Storage) -> None:
    other = "b" * 32
    keys = [job_key(JOB, "z.pt"), job_key(JOB, "checkpoints/a.pt"), job_key(other, "x")]
    for k in keys:
        storage.write_bytes(k, k.encode())
    storage.write_bytes(f"bundles/{'c' * 64}.tar.gz", b"gz")
    mine = [o.key for o in storage.list(f"jobs/{JOB}")]
    assert mine == sorted(keys[:2])
    assert [o.size for o in storage.list(f"jobs/{JOB}")] == [len(k) for k in sorted(keys[:2])]
    assert len(list(storage.list(""))) == 4
    assert list(storage.list("jobs/nobody")) == []
    assert storage.delete(keys[0]) is True and not storage.exists(keys[0])
    assert [o.key for o in storage.list(f"jobs/{JOB}/")] == [keys[1]]


@pytest.mark.parametrize(
    "bad",
    ["", "/etc/passwd", "../x", f"jobs/{JOB}/../../x", "a/\x00b", ".", "a/../../b"],
)
def test_unsafe_keys_are_refused_by_every_operation(storage: Storage, bad: str) -> None:
    for call in (
        lambda: storage.stat(bad),
        lambda: storage.exists(bad),
        lambda: storage.open_read(bad),
        lambda: storage.write_bytes(bad, b"x"),
        lambda: storage.append(bad, b"x"),
        lambda: storage.delete(bad),
        lambda: storage.local_path(bad),
        lambda: storage.open_tail(bad),
    ):
        with pytest.raises(UnsafePath):
            call()


def test_keys_are_canonical() -> None:
    assert check_key("jobs//x/./y.pt") == "jobs/x/y.pt"
    assert check_key("", allow_empty=True) == ""
    assert job_key(JOB, "./checkpoints//s.pt") == f"jobs/{JOB}/checkpoints/s.pt"
    for bad_id in ("A" * 32, "a" * 31, "../" + "a" * 29, ""):
        with pytest.raises(UnsafePath, match="not a job id"):
            job_key(bad_id, "x")


def test_same_key_same_object_whatever_its_spelling(storage: Storage) -> None:
    storage.write_bytes(f"jobs/{JOB}/./ckpt//a.pt", b"x")
    assert storage.read_range(f"jobs/{JOB}/ckpt/a.pt", 0, 9) == (b"x", 1)


def test_local_copy_holds_the_object(storage: Storage) -> None:
    storage.write_bytes(KEY, DATA)
    copy = storage.local_copy(KEY)
    assert copy.read_bytes() == DATA
    local = storage.local_path(KEY)
    assert local is None or local == copy  # no copy where the object is a local file


def test_run_dir_and_staging_dir_are_local_folders(storage: Storage) -> None:
    rd = storage.run_dir(JOB)
    assert rd.is_absolute() and rd.name == JOB
    staging = storage.staging_dir("bundles")
    assert staging.is_dir()
    with pytest.raises(UnsafePath):
        storage.run_dir("../" + "a" * 29)


def test_the_backend_is_chosen_by_the_url_scheme(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "st")
    assert backend_class("file") is LocalStorage and backend_class("memory") is MemoryStorage
    with pytest.raises(ValueError, match="no storage backend for s4://"):
        backend_class("s4")
    local = storage_for(settings)
    assert isinstance(local, LocalStorage) and local.root == (tmp_path / "st").resolve()
    assert storage_for(settings) is local  # one instance per storage
    assert run_dir(settings, JOB) == (tmp_path / "st" / "jobs" / JOB).resolve()
    assert isinstance(open_storage("memory://", settings), MemoryStorage)
