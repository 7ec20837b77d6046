"""The fault suite's own checks can fail: the overlap detector on hand-made timelines; the
object-store checks (a listed checkpoint, a succeeded job's weights) on an in-memory store
with an object missing or not the bytes recorded; events read from several hosts."""

from __future__ import annotations

import hashlib
from pathlib import Path

from invariants import (
    CheckpointRow,
    checkpoint_problems,
    events_of,
    notification_problems,
    overlaps,
    weights_problem,
)

from torchyard.storage.memory import MemoryStorage
from torchyard.store.paths import EVENTS_FILE


def _ev(attempt: int, t: float) -> dict[str, object]:
    return {"type": "metric", "attempt": attempt, "time": t}


def test_overlap_detector() -> None:
    sequential = [_ev(1, 0), _ev(1, 5), _ev(2, 6), _ev(2, 9), _ev(3, 10)]
    assert overlaps(sequential) == []
    # attempt 1 went on writing after attempt 2 had started (a stale trainer)
    assert overlaps([_ev(1, 0), _ev(2, 4), _ev(1, 5), _ev(2, 8)]) == [(1, 2)]
    # a long first attempt spanning two later ones
    assert overlaps([_ev(1, 0), _ev(2, 2), _ev(2, 3), _ev(3, 5), _ev(1, 9)]) == [(1, 2), (1, 3)]
    assert overlaps([{"type": "metric", "time": 1.0}]) == []  # no attempt number: no claim


def _store(tmp_path: Path) -> MemoryStorage:
    return MemoryStorage(tmp_path / "scratch")


def _row(path: str, data: bytes, kind: str = "resume", *, deleted: bool = False) -> CheckpointRow:
    return CheckpointRow(path, len(data), hashlib.sha256(data).hexdigest(), kind, deleted)


JOB = "0" * 32


def _put(store: MemoryStorage, row: CheckpointRow, data: bytes) -> None:
    """`data` where the row's object is: the key named by its path and recorded sha256."""
    store.write_bytes(store.checkpoint_key(JOB, row.path, row.sha256), data)


def test_a_listed_checkpoint_must_be_in_the_store_as_recorded(tmp_path: Path) -> None:
    store = _store(tmp_path)
    good, other = b"state at step 10", b"state at step 20"
    rows = [_row("checkpoints/step-10.pt", good)]
    _put(store, rows[0], good)
    assert checkpoint_problems(store, JOB, rows) == []
    # a pruned (deleted) row needs no object
    gone = _row("checkpoints/step-5.pt", b"pruned", deleted=True)
    assert checkpoint_problems(store, JOB, [*rows, gone]) == []
    # reported but never uploaded: missing
    missing = checkpoint_problems(store, JOB, [_row("checkpoints/step-30.pt", b"x")])
    assert len(missing) == 1 and "not in the object store" in missing[0]
    # under the plain path only (as before content-named keys): still missing
    plain = _row("checkpoints/step-40.pt", b"y")
    store.write_bytes(f"jobs/{JOB}/checkpoints/step-40.pt", b"y")
    assert "not in the object store" in checkpoint_problems(store, JOB, [plain])[0]
    # stored, but not the bytes recorded (same size, another sha256)
    forged = CheckpointRow("checkpoints/step-20.pt", len(b"not the recorded bytes"),
                           hashlib.sha256(other).hexdigest())  # fmt: skip
    _put(store, forged, b"not the recorded bytes")
    (bad,) = checkpoint_problems(store, JOB, [forged])
    assert "sha256" in bad and bad.startswith(JOB)
    # another size
    short_row = _row("checkpoints/step-20.pt", other)
    _put(store, short_row, b"not the recorded bytes")
    (short,) = checkpoint_problems(store, JOB, [short_row])
    assert "bytes stored" in short


def test_a_succeeded_job_needs_its_weights_stored_as_recorded(tmp_path: Path) -> None:
    store = _store(tmp_path)
    weights = b"safetensors bytes"
    resume = _row("checkpoints/step-10.pt", b"state")
    assert "no weights on record" in str(weights_problem(store, JOB, [resume]))
    row = _row("model.safetensors", weights, kind="weights")
    assert "not in the object store" in str(weights_problem(store, JOB, [resume, row]))
    _put(store, row, b"safetensors BYTES")  # same size
    assert "sha256" in str(weights_problem(store, JOB, [resume, row]))
    _put(store, row, weights)
    assert weights_problem(store, JOB, [resume, row]) is None


def test_events_are_read_from_every_host_including_a_sparse_start(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    first = b'{"type": "metric", "attempt": 1, "time": 1.0, "name": "loss", "step": 1}\n'
    (a / "jobs" / JOB).mkdir(parents=True)
    (a / "jobs" / JOB / EVENTS_FILE).write_bytes(first + b'{"type": "metr')  # torn
    # host b took attempt 2: its file starts as NULs up to the recorded offset
    second = b'{"type": "metric", "attempt": 2, "time": 2.0, "name": "loss", "step": 2}\n'
    (b / "jobs" / JOB).mkdir(parents=True)
    (b / "jobs" / JOB / EVENTS_FILE).write_bytes(b"\0" * (len(first) - 1) + b"\n" + second)
    evs = events_of([a, b, tmp_path / "c"], JOB)
    assert [(e["attempt"], e["step"]) for e in evs] == [(1, 1), (2, 2)]


def test_notification_check() -> None:
    jobs = {"a": {"state": "succeeded"}, "b": {"state": "failed"}, "c": {"state": "running"}}
    assert notification_problems(jobs, [("d1", "job.succeeded", "a"), ("d1", "job.succeeded", "a"),
                                        ("d2", "job.failed", "b")]) == []  # fmt: skip
    lost = notification_problems(jobs, [("d1", "job.succeeded", "a")])
    assert lost == ["b: no job.failed notification received"]
    wrong = notification_problems(jobs, [("d1", "job.failed", "a"), ("d2", "job.failed", "b")])
    assert wrong == ["a: no job.succeeded notification received"]
    twice = notification_problems(jobs, [("d1", "job.succeeded", "a"), ("d3", "job.succeeded", "a"),
                                         ("d2", "job.failed", "b")])  # fmt: skip
    assert twice == ["a: job.succeeded notified as 2 deliveries"]
