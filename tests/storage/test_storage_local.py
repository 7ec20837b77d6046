"""What the local backend promises beyond the contract: a key never goes through a symlink
(out of its scope or not), writes are atomic renames that leave no temporary file, a move
into storage is a rename (no copy), and the run directory is the job's folder itself."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from torchyard.storage import UnsafePath, job_key
from torchyard.storage.local import LocalStorage
from torchyard.store.paths import job_dir

JOB, OTHER = "a" * 32, "b" * 32


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "root")


def test_objects_are_files_under_the_root(storage: LocalStorage) -> None:
    key = job_key(JOB, "checkpoints/s.pt")
    storage.write_bytes(key, b"x")
    path = storage.root / "jobs" / JOB / "checkpoints" / "s.pt"
    assert path.read_bytes() == b"x"
    assert storage.local_path(key) == path and storage.local_copy(key) == path
    assert storage.run_dir(JOB) == job_dir(storage.root, JOB) == storage.root / "jobs" / JOB
    assert storage.describe(key) == str(path)


def test_symlinks_out_of_a_keys_scope_are_refused(storage: LocalStorage, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"top secret")
    storage.write_bytes(job_key(OTHER, "x.pt"), b"another job's file")
    folder = storage.run_dir(JOB) / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "out.pt").symlink_to(secret)
    (folder / "dir").symlink_to(tmp_path)
    (folder / "neighbour.pt").symlink_to(storage.run_dir(OTHER) / "x.pt")
    (folder / "real.pt").write_bytes(b"mine")
    (folder / "inside.pt").symlink_to(folder / "real.pt")
    for rel in ("checkpoints/out.pt", "checkpoints/dir/secret.txt", "checkpoints/neighbour.pt"):
        with pytest.raises(UnsafePath):
            storage.stat(job_key(JOB, rel))
        with pytest.raises(UnsafePath):
            storage.write_bytes(job_key(JOB, rel), b"overwrite")
    assert secret.read_bytes() == b"top secret"
    # A link is refused even when it stays inside the job's folder: nothing follows links.
    with pytest.raises(UnsafePath):
        storage.read_range(job_key(JOB, "checkpoints/inside.pt"), 0, 9)
    assert storage.read_range(job_key(JOB, "checkpoints/real.pt"), 0, 9) == (b"mine", 4)
    bundles = storage.root / "bundles"
    bundles.mkdir()
    (bundles / f"{'c' * 64}.tar.gz").symlink_to(secret)
    with pytest.raises(UnsafePath):
        storage.open_read(f"bundles/{'c' * 64}.tar.gz")


def test_directories_are_not_objects(storage: LocalStorage) -> None:
    (storage.run_dir(JOB) / "checkpoints").mkdir(parents=True)
    for key in (job_key(JOB, "checkpoints"), f"jobs/{JOB}"):
        assert not storage.exists(key)
        with pytest.raises(FileNotFoundError):
            storage.read_range(key, 0, 1)
        assert storage.delete(key) is False
    assert list(storage.list(f"jobs/{JOB}")) == []


def test_atomic_writes_leave_no_temporary_file_and_readers_never_see_half(
    storage: LocalStorage,
) -> None:
    key = job_key(JOB, "model.safetensors")
    old, new = b"o" * (1 << 20), b"n" * (4 << 20)
    storage.write_bytes(key, old)
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            data, size = storage.read_range(key, 0, 8 << 20)
            assert data in (old, new) and size == len(data)
            seen.add(len(data))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(20):
            storage.write_bytes(key, new if i % 2 == 0 else old)
    finally:
        stop.set()
        t.join()
    assert os.listdir(storage.run_dir(JOB)) == ["model.safetensors"]
    assert [o.key for o in storage.list("")] == [key]


def test_a_failed_write_keeps_the_old_object(storage: LocalStorage) -> None:
    key = job_key(JOB, "spec.json")
    storage.write_bytes(key, b"old")

    class Broken:
        def read(self, n: int = -1) -> bytes:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        storage.write_stream(key, Broken())  # type: ignore[arg-type]
    assert storage.read_range(key, 0, 9) == (b"old", 3)
    assert os.listdir(storage.run_dir(JOB)) == ["spec.json"]


def test_a_move_from_the_staging_dir_is_a_rename(storage: LocalStorage) -> None:
    staging = storage.staging_dir("bundles")
    assert staging == storage.root / "bundles" / "tmp"
    src = staging / "upload-1.tar.gz"
    src.write_bytes(b"gz")
    inode = src.stat().st_ino
    key = f"bundles/{'d' * 64}.tar.gz"
    storage.write_file(key, src, move=True)
    assert not src.exists()
    assert storage.local_path(key).stat().st_ino == inode  # the same file: nothing copied


def test_the_file_tail_keeps_its_file_open(storage: LocalStorage) -> None:
    key = job_key(JOB, "events.jsonl")
    storage.append(key, b"a\n")
    tail = storage.open_tail(key, 0)
    assert tail.read() == b"a\n"
    path = storage.local_path(key)
    renamed = path.with_name("rotated")
    os.rename(path, renamed)  # the open file is still read, as a running tail would
    with renamed.open("ab") as f:
        f.write(b"b\n")
    assert tail.read() == b"b\n"
    tail.close()
