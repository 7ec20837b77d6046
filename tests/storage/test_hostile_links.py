"""Hostile tenants, issue 25: the local storage follows no link a job planted, in the file
itself or in any folder on its way, whatever it points at, and a FIFO never blocks a
reader."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from torchyard.storage import UnsafePath, job_key
from torchyard.storage.local import FileTail, LocalStorage

pytestmark = pytest.mark.hostile

JOB, OTHER = "a" * 32, "b" * 32


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    s = LocalStorage(tmp_path / "root")
    s.write_bytes(job_key(JOB, "own.txt"), b"my own file")
    s.write_bytes(job_key(OTHER, "logs/output.log"), b"another job's log")
    return s


def _reads(storage: LocalStorage, key: str) -> list[object]:
    """Every way the API and the worker read a stored file."""
    return [
        lambda: storage.stat(key),
        lambda: storage.read_range(key, 0, 100),
        lambda: storage.open_read(key).read(),
        lambda: storage.local_path(key),
        lambda: storage.local_copy(key),
    ]


@pytest.mark.parametrize("where", ["file", "folder", "run dir"])
def test_no_read_goes_through_a_link(storage: LocalStorage, where: str) -> None:
    run = storage.run_dir(JOB)
    early = storage.open_tail(job_key(JOB, "logs/output.log" if where != "file" else "output.log"))
    if where == "file":  # output.log -> a file of the job's own folder
        (run / "output.log").symlink_to(run / "own.txt")
        key = job_key(JOB, "output.log")
    elif where == "folder":  # logs/ -> another job's folder
        (run / "logs").symlink_to(storage.run_dir(OTHER) / "logs")
        key = job_key(JOB, "logs/output.log")
    else:  # the run directory itself
        os.rename(run, run.with_name("moved"))
        run.symlink_to(storage.run_dir(OTHER))
        key = job_key(JOB, "logs/output.log")
    for read in _reads(storage, key):
        with pytest.raises(UnsafePath):
            read()  # type: ignore[operator]
    with pytest.raises(UnsafePath):
        storage.open_tail(key)
    assert early.read() == b""  # opened before the link was planted: never its target
    early.close()


def test_a_write_never_goes_through_a_link(storage: LocalStorage, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep")
    run = storage.run_dir(JOB)
    (run / "output.log").symlink_to(outside)
    with pytest.raises(UnsafePath):
        storage.append(job_key(JOB, "output.log"), b"appended")
    with pytest.raises(UnsafePath):
        storage.write_bytes(job_key(JOB, "output.log"), b"over")
    assert outside.read_bytes() == b"keep"


def test_a_fifo_is_no_object_and_never_blocks(storage: LocalStorage) -> None:
    fifo = storage.run_dir(JOB) / "output.log"
    os.mkfifo(fifo)
    key = job_key(JOB, "output.log")
    done: list[bool] = []

    def read_all() -> None:
        for read in (lambda: storage.read_range(key, 0, 10), lambda: storage.open_read(key)):
            with pytest.raises(FileNotFoundError):
                read()
        done.append(True)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # the old code blocked in open() until a writer came
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
    assert done == [True], "a read of a FIFO blocked"


def test_the_workers_file_tail_ignores_a_link(tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(b'{"type": "metric"}\n')
    events = tmp_path / "events.jsonl"
    events.symlink_to(secret)
    tail = FileTail(events)
    assert tail.read() == b""
    events.unlink()
    events.write_bytes(b"real\n")
    assert tail.read() == b"real\n"
    tail.close()
