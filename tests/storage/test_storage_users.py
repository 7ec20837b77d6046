"""The service code that reads stored files through the seam, run against the in-memory
backend (no local files, as object storage will be): a bundle fetched and unpacked, init
weights fetched and checked, the resume pick, the events tail and a rank's last report."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from support.db import Factory

import torchyard.worker.inputs as inputs
from torchyard.settings import Settings
from torchyard.storage import Storage, job_key
from torchyard.storage.memory import MemoryStorage
from torchyard.store.attempts import resume_pick
from torchyard.store.bundlefiles import archive_key
from torchyard.store.checkpoints import (
    checkpoint_available,
    checkpoint_key,
    mark_deleted,
    record_checkpoint,
)
from torchyard.store.db import session_scope
from torchyard.store.models import Checkpoint
from torchyard.worker.events import EventTail, end_torn_line_at, last_rank_event_at

JOB = "a" * 32


@pytest.fixture
def mem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MemoryStorage:
    storage = MemoryStorage(tmp_path / "scratch")
    monkeypatch.setattr(inputs, "storage_for", lambda _settings: storage)
    return storage


@pytest.fixture
def plain_settings(tmp_path: Path) -> Settings:
    return Settings(_env_file=None, home=tmp_path / "home", storage_root=tmp_path / "unused")  # type: ignore[call-arg]


def _bundle() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        data = b"print('hi')\n"
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_bundle_is_fetched_once_and_unpacked(
    mem: MemoryStorage, plain_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = _bundle()
    bid = hashlib.sha256(archive).hexdigest()
    spec: dict[str, Any] = {"code": {"bundle": bid}}
    with pytest.raises(inputs.InputError, match="missing from storage"):
        inputs.code_dir(plain_settings, spec)
    mem.write_bytes(archive_key(bid), archive)
    fetched: list[str] = []
    real = mem.local_copy
    monkeypatch.setattr(
        mem, "local_copy", lambda key, sha256=None: fetched.append(key) or real(key, sha256)
    )
    tree = inputs.code_dir(plain_settings, spec)
    assert tree is not None and (tree / "train.py").read_bytes() == b"print('hi')\n"
    assert inputs.code_dir(plain_settings, spec) == tree
    assert fetched == [archive_key(bid)]  # the intact cache is used without a fetch
    assert inputs.code_dir(plain_settings, {}) is None


def test_init_weights_are_fetched_and_checked(mem: MemoryStorage, plain_settings: Settings) -> None:
    data = b"weights" * 100
    row = Checkpoint(job_id=JOB, path="model.safetensors", sha256=hashlib.sha256(data).hexdigest())
    with pytest.raises(inputs.InputError, match="is gone"):
        inputs.init_file(plain_settings, row)
    key = mem.checkpoint_key(JOB, row.path, row.sha256)  # what the worker uploaded to
    mem.write_bytes(key, data)
    path = inputs.init_file(plain_settings, row)
    assert path.read_bytes() == data and path.is_relative_to(mem.scratch)
    mem.write_bytes(key, b"changed")
    with pytest.raises(inputs.InputError, match="does not match"):
        inputs.init_file(plain_settings, row)
    hostile = Checkpoint(job_id=JOB, path="../" + "b" * 32 + "/x", sha256="0" * 64)
    with pytest.raises(inputs.InputError, match="is gone"):
        inputs.init_file(plain_settings, hostile)


def _record(db_url: str, job: str, rel: str, step: int) -> None:
    with session_scope(db_url) as s:
        record_checkpoint(
            s, job, attempt=1, step=step, epoch=None, path=rel, bytes=1, sha256="0" * 64
        )


def test_the_resume_pick_is_the_newest_checkpoint_still_stored(
    factory: Factory, db_url: str, tmp_path: Path
) -> None:
    storage: Storage = MemoryStorage(tmp_path / "scratch")
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        assert resume_pick(s, job, storage) is None
    for step in (10, 20, 30):
        _record(db_url, job, f"checkpoints/step-{step:08d}.pt", step)
    for step in (10, 20):
        rel = f"checkpoints/step-{step:08d}.pt"
        storage.write_bytes(storage.checkpoint_key(job, rel, "0" * 64), b"x")
    with session_scope(db_url) as s:  # step 30 is recorded but not in storage (yet)
        assert resume_pick(s, job, storage) == "checkpoints/step-00000020.pt"
        mark_deleted(s, job, ["checkpoints/step-00000020.pt"])
    with session_scope(db_url) as s:
        assert resume_pick(s, job, storage) == "checkpoints/step-00000010.pt"


def test_an_earlier_releases_plain_keys_are_still_read(
    mem: MemoryStorage, plain_settings: Settings, factory: Factory, db_url: str
) -> None:
    """Releases before content-named keys uploaded checkpoints and weights to their plain
    run-directory keys: after an upgrade their rows must still resume, download and serve
    as `init` weights (the deployment test's upgrade found them all unavailable)."""
    data = b"weights" * 100
    sha = hashlib.sha256(data).hexdigest()
    job = factory.job("alice", state="running")
    plain = job_key(job, "model.safetensors")
    mem.write_bytes(plain, data)  # what the earlier release uploaded
    row = Checkpoint(job_id=job, path="model.safetensors", sha256=sha)
    assert checkpoint_key(mem, row) == plain and checkpoint_available(mem, row)
    assert inputs.init_file(plain_settings, row).read_bytes() == data
    mem.write_bytes(plain, b"not what was recorded")
    with pytest.raises(inputs.InputError, match="does not match"):
        inputs.init_file(plain_settings, row)  # checked against the row as any other
    named = mem.checkpoint_key(job, row.path, sha)
    mem.write_bytes(named, data)
    assert checkpoint_key(mem, row) == named  # the content-named key first, when there
    rel = "checkpoints/step-00000010.pt"
    _record(db_url, job, rel, 10)
    mem.write_bytes(job_key(job, rel), b"x")
    with session_scope(db_url) as s:
        assert resume_pick(s, job, mem) == rel


def _line(**ev: object) -> bytes:
    return (json.dumps(ev) + "\n").encode()


def test_events_are_tailed_from_storage(tmp_path: Path) -> None:
    storage = MemoryStorage(tmp_path / "scratch")
    key = job_key(JOB, "events.jsonl")
    storage.append(key, _line(type="metric", time=1.0, step=1, name="l", value=9.0))
    start = storage.stat(key).size
    tail = EventTail.open(storage, key, start)  # an earlier attempt's line skipped
    assert tail.read() == []
    storage.append(key, _line(type="started", time=2.0) + b'{"type": "finished", "ti')
    assert [e.type for e in tail.read()] == ["started"]
    assert tail.consumed < tail.offset  # the partial line is not counted
    storage.append(key, b'me": 3.0}\n')
    assert [e.type for e in tail.read()] == ["finished"]
    assert tail.consumed == tail.offset == storage.stat(key).size
    tail.close()


def test_a_ranks_last_report_is_read_from_storage(tmp_path: Path) -> None:
    storage = MemoryStorage(tmp_path / "scratch")
    key = job_key(JOB, "events.rank1.jsonl")
    assert last_rank_event_at(storage, key, 0, 1) is None
    old = _line(type="error", time=1.0, attempt=1, kind="data", message="old")
    storage.append(key, old)
    mine = _line(type="stopped", time=2.0, attempt=2, reason="signal", step=5)
    storage.append(key, mine + b'{"type": "error", "att')  # a torn last line
    got = last_rank_event_at(storage, key, len(old), 2)
    assert got is not None and got["type"] == "stopped" and got["step"] == 5
    assert last_rank_event_at(storage, key, len(old), 1) is None


def test_a_torn_last_line_is_ended_before_the_next_trainer_appends(tmp_path: Path) -> None:
    storage = MemoryStorage(tmp_path / "scratch")
    key = job_key(JOB, "events.jsonl")
    end_torn_line_at(storage, key)  # nothing there: nothing written
    assert not storage.exists(key)
    storage.append(key, b'{"type": "started", "time": 1.0}\n{"type": "metr')
    end_torn_line_at(storage, key)
    end_torn_line_at(storage, key)  # ends in a newline now: left alone
    assert storage.read_range(key, 0, 1000)[0].endswith(b'"metr\n')
