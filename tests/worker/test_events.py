"""Tailing events.jsonl and writing its batches to the store (no processes)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_worker

from torchyard.contracts.eventmodel import event_dict
from torchyard.scheduler.cycle import schedule
from torchyard.store.lifecycle import Fenced, finish_attempt
from torchyard.store.models import Attempt, Checkpoint, Job, Metric, MetricBlock
from torchyard.store.states import A_LOST
from torchyard.worker.events import EventRecorder, EventTail

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


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
    assert [e.type for e in tail.read()] == ["started"]  # malformed skipped, partial kept
    with p.open("ab") as f:
        f.write(b'me": "train/loss", "value": 1.5}\n{"type": "finished", "time": 4')
    evs = tail.read()
    assert [(e.type, getattr(e, "value", None)) for e in evs] == [("metric", 1.5)]
    with p.open("ab") as f:
        f.write(b".0}")  # the trainer died before the newline
    assert [e.type for e in tail.read(final=True)] == ["finished"]
    tail.close()


def test_tail_skips_and_logs_lines_that_are_not_events(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = tmp_path / "events.jsonl"
    bad = [
        _line(type="metric", time=1.0, step="2", name="l", value=1.0),  # a string step
        _line(type="metric", time=1.0, step=2, name="l", value=True),  # a bool is no number
        _line(type="launched", time=1.0),  # no such event type
        _line(time=1.0, step=2),  # no type
        b"[1, 2]\n",
    ]
    good = _line(type="metric", time=1.0, step=3, name="l", value=2, future_field={"x": 1})
    p.write_bytes(b"".join(bad) + good)
    with caplog.at_level(logging.WARNING, logger="torchyard.worker.events"):
        evs = EventTail(p).read()
    assert len([r for r in caplog.records if "malformed event" in r.message]) == len(bad)
    # a newer trainer's extra field is kept; 2 stays 2 (the model does not rewrite values)
    assert [event_dict(e) for e in evs] == [json.loads(good)]


def test_tail_waits_for_a_file_that_does_not_exist_yet(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    tail = EventTail(p, EventTail.size_of(p))
    assert tail.read() == []
    p.write_bytes(_line(type="started", time=1.0))
    assert len(tail.read()) == 1


def _placed_job(s: Session) -> tuple[Job, EventRecorder]:
    """A job the scheduler placed on worker w1, and a recorder of its first attempt."""
    make_worker(s, "w1")
    job = make_job(s)
    schedule(s, heartbeat_timeout_s=10)
    s.commit()
    attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    return job, EventRecorder(job.id, attempt.id, attempt.number)


def test_recorder_batches_are_idempotent_and_start_the_job(session: Session) -> None:
    s = session
    job, rec = _placed_job(s)
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
    assert s.get(Attempt, rec.attempt_id).state == "running"  # type: ignore[union-attr]


def _counts(s: Session) -> tuple[int, int, list[tuple]]:
    s.expire_all()
    blocks = s.execute(
        select(MetricBlock.name, MetricBlock.level, MetricBlock.block, MetricBlock.n)
    ).all()
    return (
        s.scalar(select(func.count()).select_from(Metric)) or 0,
        s.scalar(select(Attempt.events_offset)) or 0,
        sorted(tuple(b) for b in blocks),
    )


def test_a_flush_commits_points_and_offset_together_and_a_resent_batch_adds_nothing(
    session: Session,
) -> None:
    s = session
    _, rec = _placed_job(s)
    for i in range(300):
        for name in ("train/loss", "train/lr", "train/samples_per_s"):
            rec.add({"type": "metric", "time": 1.0, "step": i, "epoch": 1, "name": name,
                     "value": float(i)})  # fmt: skip
    rec.offset = 12_345
    rec.write(s)
    s.rollback()  # the worker died before the commit: neither the points nor the offset
    assert _counts(s) == (0, 0, [])
    rec.write(s)
    s.commit()
    done = _counts(s)
    assert done[:2] == (900, 12_345)
    # 300 steps: blocks 0..4 of 64 steps and block 0 of 4096, for each of the three series
    assert [b for b in done[2] if b[0] == "train/lr"] == [
        ("train/lr", 64, 0, 64), ("train/lr", 64, 1, 64), ("train/lr", 64, 2, 64),
        ("train/lr", 64, 3, 64), ("train/lr", 64, 4, 44), ("train/lr", 4096, 0, 300),
    ]  # fmt: skip
    rec.write(s)  # the same batch again (the offset's commit was not seen): nothing changes
    s.commit()
    assert _counts(s) == done


def _state(s: Session, rec: EventRecorder) -> dict[str, object]:
    """Everything a flush may write: points, blocks, the attempt's offset, the job's row."""
    points, offset, blocks = _counts(s)
    job = s.get(Job, rec.job_id)
    attempt = s.get(Attempt, rec.attempt_id)
    assert job is not None and attempt is not None
    return {
        "points": points,
        "blocks": blocks,
        "offset": offset,
        "attempt": attempt.state,
        "version": job.version,
        "progress": job.progress,
        "updated_at": job.updated_at,
    }


def _batch(rec: EventRecorder, steps: range, offset: int) -> None:
    for i in steps:
        rec.add({"type": "metric", "time": 1.0, "step": i, "name": "train/loss", "value": 1.0})
    rec.add({"type": "progress", "time": 1.0, "step": steps[-1], "total_steps": 100})
    rec.offset = offset


def test_a_flush_for_an_ended_attempt_changes_nothing(session: Session) -> None:
    """The fence: once the attempt has ended, a batch (points, progress, offset) is refused
    with Fenced and writes nothing; an attempt that does not exist is refused too."""
    s = session
    _, rec = _placed_job(s)
    _batch(rec, range(10), 100)
    rec.write(s)
    s.commit()
    rec.clear()
    assert finish_attempt(s, rec.attempt_id, A_LOST, reason="reaped") == "queued"
    s.commit()
    before = _state(s, rec)
    _batch(rec, range(10, 20), 200)
    with pytest.raises(Fenced) as refused:
        rec.write(s)
    assert (refused.value.attempt_id, refused.value.state) == (rec.attempt_id, A_LOST)
    s.rollback()
    assert _state(s, rec) == before
    ghost = EventRecorder(rec.job_id, rec.attempt_id + 1000, 1)
    _batch(ghost, range(10, 20), 200)
    with pytest.raises(Fenced) as refused:
        ghost.write(s)
    assert refused.value.state is None
    s.rollback()
    assert _state(s, rec) == before


def test_a_flush_bumps_the_version_keeps_the_offset_monotonic_and_only_its_progress(
    session: Session,
) -> None:
    """A batch bumps the job's version (its ETag), moves the events offset only forward,
    and writes progress only while its attempt is the job's current one."""
    s = session
    job, rec = _placed_job(s)
    _batch(rec, range(5), 500)
    rec.write(s)
    s.commit()
    rec.clear()
    first = _state(s, rec)
    assert first["offset"] == 500 and first["progress"]["step"] == 4  # type: ignore[index]
    stale = EventRecorder(job.id, rec.attempt_id, rec.attempt_number + 1)  # type: ignore[operator]
    _batch(stale, range(5, 9), 300)  # an offset behind the recorded one
    stale.write(s)
    s.commit()
    after = _state(s, rec)
    assert (after["points"], after["offset"]) == (9, 500)  # the points land; the offset stays
    assert after["version"] == first["version"] + 1  # type: ignore[operator]
    assert after["progress"] == first["progress"]  # not the other attempt's
    assert after["updated_at"] >= first["updated_at"]  # type: ignore[operator]


@pytest.mark.postgres
def test_a_flush_holds_its_attempt_until_commit(session: Session) -> None:
    """PostgreSQL: until a flush commits, ending its attempt elsewhere waits (here: gives up
    on a lock timeout), so the end, once written, follows every point committed before."""
    s = session
    if s.get_bind().dialect.name != "postgresql":
        pytest.skip("PostgreSQL's row locks")
    _, rec = _placed_job(s)
    _batch(rec, range(10), 100)
    rec.write(s)  # not committed yet
    with Session(s.get_bind()) as other:
        other.execute(text("SET lock_timeout = '200ms'"))
        with pytest.raises(OperationalError, match="lock timeout"):
            finish_attempt(other, rec.attempt_id, A_LOST, reason="reaped")
        other.rollback()
        s.commit()
        assert finish_attempt(other, rec.attempt_id, A_LOST, reason="reaped") == "queued"
        other.commit()
    assert _counts(s)[0] == 10


def test_checkpoints_pruned_before_they_went_up_are_never_stored_and_unlist_what_they_pruned(
    session: Session, tmp_path: Path
) -> None:
    """A trainer checkpointing faster than the object store takes them (keep_last 2): a
    checkpoint whose file keep_last already deleted, or that a later one of the batch
    prunes, is not stored and not listed, and what it pruned stops being listed too."""
    import hashlib
    import time

    from torchyard.storage.memory import MemoryStorage
    from torchyard.worker.publish import CheckpointUploads, UploadPending

    s = session
    job, rec = _placed_job(s)
    store, cache = MemoryStorage(tmp_path / "scratch"), tmp_path / "cache"
    rec.uploads = CheckpointUploads(store, cache, job.id)
    run = cache / "jobs" / job.id

    def ckpt(step: int, pruned: list[int]) -> dict[str, object]:
        path = f"checkpoints/step-{step}.pt"
        data = f"weights at {step}".encode()
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run / path).write_bytes(data)
        for p in pruned:
            (run / f"checkpoints/step-{p}.pt").unlink(missing_ok=True)
        return {"type": "checkpoint", "time": float(step), "step": step, "path": path,
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "kind": "resume", "pruned": [f"checkpoints/step-{p}.pt" for p in pruned]}  # fmt: skip

    def commit(*events: dict[str, object]) -> None:
        for ev in events:
            rec.add(ev)
        deadline = time.monotonic() + 10
        while True:
            try:
                rec.commit(lambda write: (write(s), s.commit()))
                return
            except UploadPending:
                assert time.monotonic() < deadline, "the uploads never became durable"
                time.sleep(0.01)

    commit(ckpt(10, []))
    b = ckpt(20, [])
    c = ckpt(30, [10])
    d = ckpt(40, [20])  # deletes 20's file before the worker read 20's event
    commit(b)  # 20: gone from this host, never stored: skipped, not set aside
    commit(c, d, ckpt(50, [30]))  # 30: pruned within the batch, never uploaded
    # 60 went up while its batch waited (a trainer's last lines, read at its exit), then 70
    # of the same batch pruned it: recorded never, its object removed all the same (CI
    # found one left over before).
    real_write, going_up = store.write_file, threading.Event()

    def slow_write(*a: Any, **kw: Any) -> Any:
        going_up.set()  # the file is open: what the trainer deletes now still goes up
        time.sleep(0.3)
        return real_write(*a, **kw)

    store.write_file = slow_write  # type: ignore[method-assign]
    rec.add(ckpt(60, [40]))
    with pytest.raises(UploadPending):
        rec.commit(lambda write: (write(s), s.commit()))
    assert going_up.wait(5) and rec.uploads.started("checkpoints/step-60.pt")
    commit(ckpt(70, [50, 60]))
    rec.uploads.close()
    s.expire_all()
    listed = s.scalars(
        select(Checkpoint.step).where(Checkpoint.job_id == job.id, Checkpoint.deleted.is_(False))
    ).all()
    assert sorted(listed) == [70]
    stored = {o.key for o in store.list(f"jobs/{job.id}/checkpoints")}
    assert stored == {
        store.checkpoint_key(
            job.id,
            f"checkpoints/step-{n}.pt",
            hashlib.sha256(f"weights at {n}".encode()).hexdigest(),
        )
        for n in (70,)
    }
    assert rec.set_aside.count == 0
