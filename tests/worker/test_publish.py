"""worker/publish.py against the in-memory backend (a store whose objects are not local
files, as an object store's): checkpoints go up checked before they are reported, logs are
shipped without loss across an outage, a new host's events file continues the record, and
nothing a trainer plants in its run directory is followed."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from torchyard.contracts.eventmodel import CheckpointEvent
from torchyard.storage import job_key
from torchyard.storage.base import ObjectInfo, StorageUnavailable
from torchyard.storage.keys import stored_file_key
from torchyard.storage.memory import MemoryStorage
from torchyard.worker import publish
from torchyard.worker.logpump import LogPump
from torchyard.worker.publish import (
    CheckpointRefused,
    CheckpointUploads,
    LogShipper,
    align_events,
)

JOB = "c" * 32


class Flaky(MemoryStorage):
    """Refuses the next `down` writes and appends as an unreachable store would."""

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.down = 0

    def _outage(self) -> None:
        if self.down:
            self.down -= 1
            raise StorageUnavailable("the object store is out of reach")

    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        self._outage()
        return super().write_file(key, path, move=move, sha256=sha256)

    def append(self, key: str, data: bytes) -> None:
        self._outage()
        super().append(key, data)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def store(tmp_path: Path) -> Flaky:
    return Flaky(tmp_path / "scratch")


def _ckpt(cache: Path, rel: str, data: bytes, sha: str | None = None) -> CheckpointEvent:
    path = cache / "jobs" / JOB / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    digest = sha or hashlib.sha256(data).hexdigest()
    return CheckpointEvent(type="checkpoint", time=time.time(), step=10, path=rel,
                           bytes=len(data), sha256=digest, kind="resume")  # fmt: skip


def _key(c: CheckpointEvent) -> str:
    """Where an object store keeps `c`'s file: its path and its sha256."""
    return stored_file_key(JOB, c.path or "", c.sha256 or "")


def _until_ready(up: CheckpointUploads, c: CheckpointEvent, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not up.ready(c):
        assert time.monotonic() < deadline, "upload never became durable"
        time.sleep(0.01)


def test_a_checkpoint_is_ready_only_once_stored_with_its_sha256(store: Flaky, cache: Path) -> None:
    up = CheckpointUploads(store, cache, JOB)
    data = os.urandom(200_000)
    c = _ckpt(cache, "checkpoints/step-00000010.pt", data)
    assert up.ready(c) is False  # started, not done: the batch waits
    _until_ready(up, c)
    info = store.stat(_key(c))
    assert info.size == len(data) and info.sha256 == c.sha256
    assert not store.exists(job_key(JOB, c.path or ""))  # only under the name of its bytes
    up.close()


def test_a_file_that_is_not_what_its_event_announced_is_refused(store: Flaky, cache: Path) -> None:
    up = CheckpointUploads(store, cache, JOB)
    c = _ckpt(cache, "checkpoints/step-00000010.pt", b"torn", sha="0" * 64)
    with pytest.raises(CheckpointRefused, match="does not match the sha256"):
        _until_ready(up, c)
    assert not store.exists(_key(c))
    up.close()


def test_a_pruned_file_is_refused_unless_an_earlier_attempt_stored_it(
    store: Flaky, cache: Path
) -> None:
    up = CheckpointUploads(store, cache, JOB)
    c = _ckpt(cache, "checkpoints/step-00000010.pt", b"weights")
    (cache / "jobs" / JOB / (c.path or "")).unlink()
    with pytest.raises(CheckpointRefused, match="not on this host"):
        _until_ready(up, c)
    # Uploaded by an attempt whose record did not commit: the object is the proof.
    store.write_bytes(_key(c), b"weights")
    up2 = CheckpointUploads(store, cache, JOB)
    _until_ready(up2, c)
    up.close()
    up2.close()


def test_a_planted_link_is_never_uploaded(store: Flaky, cache: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"the worker's own file")
    link = cache / "jobs" / JOB / "checkpoints" / "step-00000010.pt"
    link.parent.mkdir(parents=True)
    link.symlink_to(secret)
    c = CheckpointEvent(type="checkpoint", time=time.time(), step=10,
                        path="checkpoints/step-00000010.pt",
                        sha256=hashlib.sha256(secret.read_bytes()).hexdigest())  # fmt: skip
    up = CheckpointUploads(store, cache, JOB)
    with pytest.raises(CheckpointRefused):
        _until_ready(up, c)
    assert not store.exists(_key(c))
    up.close()


def test_an_outage_delays_the_upload_then_it_goes_up(
    store: Flaky, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "RETRY_FIRST_S", 0.05)
    store.down = 3
    up = CheckpointUploads(store, cache, JOB)
    c = _ckpt(cache, "checkpoints/step-00000010.pt", b"x" * 1000)
    _until_ready(up, c)
    assert store.down == 0 and store.exists(_key(c))
    up.close()


def test_pruned_objects_are_deleted(store: Flaky, cache: Path) -> None:
    up = CheckpointUploads(store, cache, JOB)
    c = _ckpt(cache, "checkpoints/step-00000010.pt", b"old")
    _until_ready(up, c)
    up.delete_pruned([(c.path or "", c.sha256 or "")])
    up.close()
    assert not store.exists(_key(c))


def test_a_pruned_checkpoint_of_an_earlier_release_is_deleted_by_its_plain_key(
    store: Flaky, cache: Path
) -> None:
    """Resumed after an upgrade, a job's keep_last prunes checkpoints an earlier release
    uploaded to plain keys: those objects go too, not only content-named ones."""
    up = CheckpointUploads(store, cache, JOB)
    plain = job_key(JOB, "checkpoints/step-00000010.pt")
    store.write_bytes(plain, b"old")
    up.delete_pruned([("checkpoints/step-00000010.pt", hashlib.sha256(b"old").hexdigest())])
    up.close()
    assert not store.exists(plain)


def test_a_fenced_attempt_still_uploading_never_replaces_what_a_later_one_recorded(
    store: Flaky, tmp_path: Path
) -> None:
    """The chaos suite's finding: attempt 1's worker, cut off from the database but not
    from the store, finished uploading its step-40 after attempt 2 had recorded its own
    (same path, other bytes: the files carry their attempt). The recorded row must still
    name the bytes it recorded."""
    rel = "checkpoints/step-00000040.pt"
    old_host, new_host = tmp_path / "host-a", tmp_path / "host-b"
    recorded = _ckpt(new_host, rel, b"attempt 2's step 40")
    up_new = CheckpointUploads(store, new_host, JOB)
    _until_ready(up_new, recorded)  # durable, then its row commits (sha256 of attempt 2)
    zombie = _ckpt(old_host, rel, b"attempt 1's step 40")
    up_old = CheckpointUploads(store, old_host, JOB)
    _until_ready(up_old, zombie)  # its record will be fenced; its bytes still went up
    key = store.checkpoint_key(JOB, rel, recorded.sha256 or "")
    with store.open_read(key) as f:
        assert f.read() == b"attempt 2's step 40"
    assert store.stat(key).sha256 == recorded.sha256
    up_new.close()
    up_old.close()


def test_an_event_without_its_sha256_is_refused_by_an_object_store(
    store: Flaky, cache: Path
) -> None:
    c = _ckpt(cache, "checkpoints/step-00000010.pt", b"state")
    bare = c.model_copy(update={"sha256": None})
    up = CheckpointUploads(store, cache, JOB)
    with pytest.raises(CheckpointRefused, match="without its sha256"):
        _until_ready(up, bare)
    up.close()


def test_the_log_ships_whole_and_in_order_across_an_outage(
    store: Flaky, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish, "SHIP_S", 0.02)
    monkeypatch.setattr(publish, "SHIP_MAX", 64)
    log_path = tmp_path / "run" / "output.log"
    log_path.parent.mkdir()
    log_path.write_bytes(b"a stale local copy, never shipped again\n")
    key = job_key(JOB, "output.log")
    earlier = b"an earlier attempt's lines, already stored\n"
    store.append(key, earlier)
    ship = LogShipper(store, log_path, key)
    # This attempt's local log holds only holes where the stored log's bytes are.
    assert log_path.read_bytes() == b"\0" * len(earlier)
    lines = [f"line {i}\n".encode() for i in range(200)]
    with open(log_path, "ab") as f:
        for i, line in enumerate(lines):
            if i == 50:
                store.down = 5
            f.write(line)
            f.flush()
            time.sleep(0.001)
    # A trainer swaps its log for a link: the shipper reads the file it opened.
    os.replace(log_path, tmp_path / "run" / "moved")
    log_path.symlink_to("/etc/passwd")
    ship.close(wait_s=5)
    data, size = store.read_range(key, 0, 1 << 20)
    assert data == earlier + b"".join(lines) and size == len(data)


def test_the_log_cap_counts_every_attempt_on_any_host(store: Flaky, tmp_path: Path) -> None:
    """TORCHYARD_MAX_LOG_BYTES caps the job's log, not each attempt's: a new attempt on a
    fresh host gets only what the stored log has left."""
    key = job_key(JOB, "output.log")
    store.append(key, b"x" * 900)
    log_path = tmp_path / "fresh-host" / "output.log"
    ship = LogShipper(store, log_path, key)
    r, w = os.pipe()
    pump = LogPump(r, 1000, log_path)
    os.write(w, b"y" * 500)
    os.close(w)
    pump.join(5)
    ship.close(wait_s=5)
    data, _ = store.read_range(key, 0, 1 << 20)
    assert data.startswith(b"x" * 900 + b"y" * 100)
    assert b"y" * 101 not in data and b"log cut" in data


def test_a_new_host_continues_the_record_and_a_stale_file_is_cut(tmp_path: Path) -> None:
    events = tmp_path / "run" / "events.jsonl"
    align_events(events, attempt=2, recorded=5000)  # a host that never ran the job
    assert events.stat().st_size == 5000 and events.read_bytes()[-1:] == b"\n"
    assert events.stat().st_blocks * 512 < 5000  # sparse: only the length is kept
    # Attempt 3 on the same host: the file is attempt 2's own, with its unrecorded tail.
    with open(events, "ab") as f:
        f.write(b'{"type": "metric"}\n')
    align_events(events, attempt=3, recorded=5000)
    assert events.stat().st_size == 5000 + 19
    # Attempt 5 here after attempt 4 ran elsewhere: what lies past the record is stale,
    # what lies before it is the record and is kept (the checks read it back).
    with open(events, "r+b") as f:
        f.write(b'{"type": "metric", "step": 1}\n')
    align_events(events, attempt=5, recorded=4000)
    assert events.stat().st_size == 4000
    assert events.read_bytes().startswith(b'{"type": "metric", "step": 1}\n')


def test_the_upload_thread_runs_at_a_lower_cpu_priority(store: Flaky, cache: Path) -> None:
    """On a host with no spare core the trainer, not the upload, gets the CPU."""
    seen: list[int] = []
    up = CheckpointUploads(store, cache, JOB)
    up._submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    up.close()
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + publish.UPLOAD_NICE)]
