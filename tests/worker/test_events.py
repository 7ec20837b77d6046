"""Tailing events.jsonl and writing its batches to the store (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from worker_factories import make_job, make_worker

from torchyard.store.models import Attempt, Checkpoint, Job, Metric
from torchyard.store.scheduling import schedule
from torchyard.worker.events import EventRecorder, EventTail


def _line(**ev: object) -> bytes:
    return (json.dumps(ev) + "\n").encode()


def test_tail_reads_only_complete_lines_from_the_offset(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    old = _line(type="metric", time=1.0, step=1, name="train/loss", value=9.0)
    p.write_bytes(old)
    tail = EventTail(p, EventTail.size_of(p))  # an earlier attempt's events are skipped
    assert tail.read() == []
    with p.open("ab") as f:
        f.write(_line(type="started", time=2.0))
        f.write(b"not json\n")
        f.write(b'{"type": "metric", "time": 3.0, "step": 2, "na')
    assert [e["type"] for e in tail.read()] == ["started"]  # malformed skipped, partial kept
    with p.open("ab") as f:
        f.write(b'me": "train/loss", "value": 1.5}\n{"type": "finished", "time": 4')
    evs = tail.read()
    assert [(e["type"], e.get("value")) for e in evs] == [("metric", 1.5)]
    with p.open("ab") as f:
        f.write(b".0}")  # the trainer died before the newline
    assert [e["type"] for e in tail.read(final=True)] == ["finished"]
    tail.close()


def test_tail_waits_for_a_file_that_does_not_exist_yet(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    tail = EventTail(p, EventTail.size_of(p))
    assert tail.read() == []
    p.write_bytes(_line(type="started", time=1.0))
    assert len(tail.read()) == 1


def test_recorder_batches_are_idempotent_and_start_the_job(session: Session) -> None:
    s = session
    make_worker(s, "w1")
    job = make_job(s)
    schedule(s, heartbeat_timeout_s=10)
    s.commit()
    attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    rec = EventRecorder(job.id, attempt.id, attempt.number)
    events = [
        {"type": "started", "time": 1.0, "step": 0},
        *[
            {"type": "metric", "time": 1.0 + i, "step": i, "epoch": 0, "name": "train/loss", "value": 1.0 / i}
            for i in range(1, 6)
        ],
        {"type": "metric", "time": 7.0, "step": 6, "name": "train/loss", "value": float("nan")},
        {"type": "checkpoint", "time": 8.0, "step": 5, "epoch": 0, "path": "checkpoints/a.pt",
         "bytes": 10, "sha256": "ab" * 32, "kind": "resume"},
        {"type": "checkpoint", "time": 8.0, "step": 5, "path": "../escape.pt", "bytes": 1,
         "sha256": "00" * 32},
        {"type": "progress", "time": 9.0, "step": 5, "total_steps": 10, "epoch": 0,
         "samples_per_s": 100.0, "eta_s": 5.0},
    ]  # fmt: skip
    for ev in events:
        rec.add(ev)
    for _ in range(2):  # a replayed batch (resume) leaves one row per step
        rec.write(s)
        s.commit()
    rec.clear()
    assert rec.pending == 0
    s.expire_all()
    j = s.get(Job, job.id)
    assert j is not None and j.state == "running"
    assert j.progress == {
        "step": 5,
        "total_steps": 10,
        "epoch": 0,
        "samples_per_s": 100.0,
        "eta_s": 5.0,
    }
    assert s.scalar(select(func.count()).select_from(Metric)) == 5  # the NaN was dropped
    assert [c.path for c in s.scalars(select(Checkpoint))] == ["checkpoints/a.pt"]
    assert s.get(Attempt, attempt.id).state == "running"  # type: ignore[union-attr]
