"""Focused regression tests for the lifecycle under faults (issue "nothing lost, nothing
stuck"): durable ingest, fencing, the end of an attempt under store errors, liveness on
the database's clock, outcomes, and the watchdog. The reaper's patience after an outage
is tested with the scheduler process (tests/scheduler/test_scheduler_process.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from support.backends import only
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.storage.base import ObjectInfo
from torchyard.storage.memory import MemoryStorage
from torchyard.store.attempts import resume_pick, set_endpoint
from torchyard.store.db import session_scope
from torchyard.store.lifecycle import Fenced, finish_attempt
from torchyard.store.models import Attempt, Checkpoint, Job, Metric, Worker, utcnow
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, job_dir
from torchyard.store.states import A_LOST, A_SUCCEEDED
from torchyard.store.workers import heartbeat, reap_stale_workers
from torchyard.worker import supervisor
from torchyard.worker.events import EventRecorder
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import LocalTrainer
from torchyard.worker.outcome import STOP_STORE_LOST, STOP_WORKER, Ending, decide
from torchyard.worker.publish import MARKER, CheckpointUploads
from torchyard.worker.supervisor import (
    Claimed,
    Prepared,
    Supervision,
    WorkerContext,
    retry_until,
)
from torchyard.worker.watchdog import Watchdog

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


def _settings(db_url: str, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path, **kw)  # type: ignore[call-arg]


def _started(db_url: str, **job_kw: Any) -> tuple[str, int, int]:
    """A job scheduled onto worker w1: (job id, attempt id, assignment id)."""
    with session_scope(db_url) as s:
        make_worker(s, "w1")
        job = make_job(s, **job_kw)
        (d,) = schedule(s, heartbeat_timeout_s=10)
        attempt_id = s.scalars(select(Attempt.id).where(Attempt.job_id == job.id)).one()
        return job.id, attempt_id, d.assignment_id


def _line(**ev: Any) -> str:
    return json.dumps({"time": 1.0, **ev}) + "\n"


def test_ingest_resumes_where_the_store_stopped_and_old_events_never_move_the_job(
    db_url: str, tmp_path: Path
) -> None:
    """A store outage across the trainer's exit used to drop its last metrics and
    checkpoints: the next attempt tailed events.jsonl from its end. Now attempt 2's
    supervisor ingests attempt 1's unrecorded lines first (for the record: its `finished`
    does not end attempt 2), and commits the offset with them."""
    settings = _settings(db_url, tmp_path)
    job_id, a1, _ = _started(db_url)
    run_dir = job_dir(settings.storage, job_id)
    run_dir.mkdir(parents=True)
    events = run_dir / EVENTS_FILE
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "s3.pt").write_bytes(b"x")  # recorded as the worker reads it
    sha = hashlib.sha256(b"x").hexdigest()
    committed = _line(type="metric", attempt=1, step=1, name="train/loss", value=2.0)
    unrecorded = "".join(
        [
            *(_line(type="metric", attempt=1, step=i, name="train/loss", value=1 / i) for i in (2, 3)),
            _line(type="checkpoint", attempt=1, step=3, path="checkpoints/s3.pt", bytes=1, sha256=sha),
            _line(type="finished", attempt=1, step=3),
        ]
    )  # fmt: skip
    events.write_text(committed + unrecorded + '{"type": "metric", "att')  # torn by the kill
    with session_scope(db_url) as s:
        s.execute(update(Attempt).where(Attempt.id == a1).values(events_offset=len(committed)))
        assert finish_attempt(s, a1, A_LOST, reason="worker lost") == "queued"
        make_worker(s, "w2")
        (d,) = schedule(s, heartbeat_timeout_s=10)
        a2 = s.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == 2)).one()
        claimed = Claimed(d.assignment_id, a2.id, 2, job_id, 0, 1, {}, False)
    ctx = WorkerContext(settings, "w2", Device("cpu", None, "cpu", None), "127.0.0.1")
    sup = Supervision(ctx, claimed)
    start = sup._ingest_backlog()
    assert start == events.stat().st_size and events.read_bytes().endswith(b"\n")
    with session_scope(db_url) as s:
        steps = s.scalars(select(Metric.step).where(Metric.job_id == job_id)).all()
        assert sorted(steps) == [2, 3]  # step 1 was committed before: not read again
        ck = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).one()
        assert (ck.path, ck.attempt) == ("checkpoints/s3.pt", 1)
        job = s.get(Job, job_id)
        assert job is not None and job.state == "starting"  # attempt 1's `finished` ignored
        assert s.get(Attempt, a2.id).events_offset == start  # type: ignore[union-attr]
    assert not sup.recorder.outcome.finished


def _retried_gang(db_url: str, run_dir_of: Any) -> tuple[str, list[Claimed]]:
    """A world_size-2 job whose attempt 1 was lost after its trainer wrote a checkpoint
    the store never recorded (still in events.jsonl, file on disk); attempt 2 scheduled on
    w0 and w1. Returns (job id, the two ranks' claims, rank 0 first)."""
    with session_scope(db_url) as s:
        make_worker(s, "w0")
        make_worker(s, "w1")
        job = make_job(s, world_size=2)
        job_id, spec = job.id, dict(job.spec)
        schedule(s, heartbeat_timeout_s=10)
        a1 = s.scalars(select(Attempt.id).where(Attempt.job_id == job_id)).one()
    run_dir = run_dir_of(job_id)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "s3.pt").write_bytes(b"weights")
    (run_dir / EVENTS_FILE).write_text(
        _line(type="metric", attempt=1, step=3, name="train/loss", value=0.5)
        + _line(
            type="checkpoint",
            attempt=1,
            step=3,
            path="checkpoints/s3.pt",
            bytes=7,
            sha256=hashlib.sha256(b"weights").hexdigest(),  # checked before a rank resumes
        )
    )
    with session_scope(db_url) as s:
        assert finish_attempt(s, a1, A_LOST, reason="worker lost") == "queued"
        for w in s.scalars(select(Worker)):
            w.state, w.current_job_id = "idle", None
        dispatches = schedule(s, heartbeat_timeout_s=10)
        a2 = s.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == 2)).one()
        claims = [
            Claimed(d.assignment_id, a2.id, 2, job_id, d.rank, 2, spec, False)
            for d in sorted(dispatches, key=lambda d: d.rank)
        ]
    return job_id, claims


def test_every_rank_resumes_from_the_checkpoint_rank_0_picked(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's worker used to look up the resume checkpoint itself, before rank 0's had
    recorded the previous attempt's last checkpoint from its backlog: rank 0 resumed from
    step 3 and rank 1 started fresh, a step apart (the chaos soak saw the gang hang at its
    next checkpoint; weights that differ from an uninterrupted run are the other way it
    shows). Now rank 0 publishes its pick with its endpoint, and every rank takes it."""
    settings = _settings(db_url, tmp_path)
    job_id, (c0, c1) = _retried_gang(db_url, lambda j: job_dir(settings.storage, j))
    waiting = threading.Event()
    real_read = supervisor.read_endpoint

    def read_endpoint(*args: Any) -> Any:
        waiting.set()  # rank 1 has done all it does before the rendezvous
        return real_read(*args)

    monkeypatch.setattr(supervisor, "read_endpoint", read_endpoint)
    device = Device("cpu", None, "cpu", None)
    rank1 = Supervision(WorkerContext(settings, "w1", device, "127.0.0.1"), c1)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(p=rank1._prepare()))
    t.start()
    assert waiting.wait(30)
    p0 = Supervision(WorkerContext(settings, "w0", device, "127.0.0.1"), c0)._prepare()
    t.join(30)
    expected = job_dir(settings.storage, job_id) / "checkpoints" / "s3.pt"
    assert isinstance(p0, Prepared) and p0.resume == expected
    assert isinstance(got["p"], Prepared) and got["p"].resume == expected
    assert got["p"].master == p0.master and rank1.resume_rel == "checkpoints/s3.pt"
    with session_scope(db_url) as s:
        a2 = s.get(Attempt, c0.attempt_id)
        assert a2 is not None and a2.resumed_from == "checkpoints/s3.pt"


def test_a_rank_that_cannot_read_rank_0s_checkpoint_fails_the_attempt_naming_the_storage(
    db_url: str, tmp_path: Path
) -> None:
    """Workers that do not share TORCHYARD_STORAGE_ROOT: rank 1 used to start fresh beside a
    resumed rank 0. Now its attempt fails (counted, retried) and says why."""
    settings = _settings(db_url, tmp_path)
    job_id, (c0, c1) = _retried_gang(db_url, lambda j: job_dir(settings.storage, j))
    with session_scope(db_url) as s:  # what rank 0's worker publishes
        set_endpoint(s, c0.attempt_id, "127.0.0.1:29500", resumed_from="checkpoints/s3.pt")
    elsewhere = _settings(db_url, tmp_path / "other-host")  # its own, empty storage
    device = Device("cpu", None, "cpu", None)
    Supervision(WorkerContext(elsewhere, "w1", device, "127.0.0.1"), c1).run()
    with session_scope(db_url) as s:
        a2 = s.get(Attempt, c1.attempt_id)
        assert a2 is not None and a2.state == "failed", a2.state if a2 else None
        assert "checkpoints/s3.pt" in (a2.reason or "")
        assert "TORCHYARD_STORAGE_ROOT" in (a2.reason or "")
        job = s.get(Job, job_id)
        assert job is not None and job.state == "queued"  # retried, not given up


def test_a_stale_attempt_cannot_write(db_url: str) -> None:
    """Fencing: once an attempt has ended (the reaper gave it up), its supervisor's writes
    are refused and nothing of them lands."""
    job_id, attempt_id, _ = _started(db_url)
    with session_scope(db_url) as s:
        finish_attempt(s, attempt_id, A_LOST, reason="reaped")
    rec = EventRecorder(job_id, attempt_id, 1)
    rec.add({"type": "metric", "attempt": 1, "step": 7, "name": "train/loss", "value": 1.0})
    rec.add({"type": "finished", "attempt": 1, "step": 7})
    with pytest.raises(Fenced), session_scope(db_url) as s:
        rec.write(s)
    with session_scope(db_url) as s:
        assert s.scalar(select(func.count()).select_from(Metric)) == 0


def test_a_job_that_finishes_before_its_started_event_is_ingested_still_succeeds(
    db_url: str,
) -> None:
    """starting -> succeeded used to be refused and the refusal swallowed: the job stayed
    `starting` forever. Now it goes through running, both recorded."""
    job_id, attempt_id, _ = _started(db_url)
    with session_scope(db_url) as s:
        assert finish_attempt(s, attempt_id, A_SUCCEEDED, reason="finished") == "succeeded"
        job = s.get(Job, job_id)
        assert job is not None and job.started_at is not None


def test_recording_the_end_outlasts_any_store_outage() -> None:
    """The end of an attempt used to be given up after ~30 s of outage, wedging the worker;
    now it is retried until the store answers (backoff capped), and a fenced answer ends
    the wait at once."""
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 4:
            raise ConnectionError("store down")
        return "recorded"

    assert retry_until("test", flaky) == "recorded" and calls["n"] == 4

    def fenced() -> None:
        raise Fenced(1, "lost")

    with pytest.raises(Fenced):
        retry_until("test", fenced)

    def bug() -> None:
        calls["n"] += 1
        raise ValueError("a bug, not an outage")

    calls["n"] = 0
    with pytest.raises(ValueError):  # never retried forever
        retry_until("test", bug)
    assert calls["n"] == 1


def test_an_attempt_its_worker_stopped_supervising_is_lost_not_stuck(db_url: str) -> None:
    """If a worker goes idle without recording its attempt's end (a bug, or a crash between
    the two writes), nobody would ever end that attempt: the reaper now does."""
    from torchyard.store.attempts import claim_assignment
    from torchyard.store.workers import lose_unsupervised_attempts, release_worker

    job_id, _, assignment_id = _started(db_url)
    with session_scope(db_url) as s:
        assert claim_assignment(s, assignment_id, "w1") is not None
        assert lose_unsupervised_attempts(s) == []  # supervised: left alone
        assert release_worker(s, "w1", assignment_id)  # gone idle, end never recorded
    with session_scope(db_url) as s:
        assert lose_unsupervised_attempts(s) == [job_id]
        job = s.get(Job, job_id)
        assert job is not None and job.state == "queued" and job.attempt == 2


def test_a_trainer_launched_for_an_attempt_ended_meanwhile_is_killed(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos soak found sandboxes left running after every job had ended: a gang's rank
    launched its trainer just as its peer's failed launch (a full disk) ended the attempt;
    recording the pid was refused (Fenced) and the supervisor returned without stopping
    the trainer, which waited for a rendezvous that never came on a worker counted idle."""
    settings = _settings(sqlite_url, tmp_path, sandbox="off")
    job_id, attempt_id, assignment_id = _started(sqlite_url)
    with session_scope(sqlite_url) as s:
        spec = dict(s.get(Job, job_id).spec)  # type: ignore[union-attr]

    def ended_meanwhile(*args: Any, **kw: Any) -> None:
        raise Fenced(attempt_id, "ended by a peer rank's failed launch")

    monkeypatch.setattr(supervisor, "mark_launched", ended_meanwhile)
    started: list[int] = []
    ctx = WorkerContext(settings, "w1", Device("cpu", None, "cpu", None), "127.0.0.1")
    ctx.on_launch = started.append
    Supervision(ctx, Claimed(assignment_id, attempt_id, 1, job_id, 0, 1, spec, False)).run()
    (pid,) = started
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left to train on
        os.kill(pid, 0)


def test_a_full_disk_does_not_stop_the_end_being_recorded(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    job_id, attempt_id, assignment_id = _started(sqlite_url)
    run_dir = job_dir(settings.storage, job_id)
    (run_dir / LOG_FILE).mkdir(parents=True)  # any write to the log fails (EISDIR)
    ctx = WorkerContext(settings, "w1", Device("cpu", None, "cpu", None), "127.0.0.1")
    sup = Supervision(ctx, Claimed(assignment_id, attempt_id, 1, job_id, 0, 1, {}, False))
    sup._log_line("===== the post-exit line =====\n")  # must not raise
    sup.recorder.add({"type": "finished", "attempt": 1, "step": 3})
    assert sup.finish(0, sup._ending(0)) == "succeeded"


def test_outcomes_for_faults() -> None:
    base = {"rank": 0, "worker_id": "w", "job_state": "running"}
    # A stopping worker whose trainer had already finished reports success, not a hand-back.
    done = decide(Ending(rc=0, stop_why=STOP_WORKER, finished=True, **base))  # type: ignore[arg-type]
    assert done is not None and done.outcome == "succeeded"
    # The kernel's OOM killer: failed, not retried (retrying gives the same).
    oom = decide(Ending(rc=-signal.SIGKILL, stop_why=None, oom_killed=True, **base))  # type: ignore[arg-type]
    assert oom is not None and (oom.outcome, oom.retryable) == ("failed", False)
    assert oom.error is not None and oom.error.startswith("out_of_memory")
    # A SIGKILL that was not the OOM killer is a lost attempt, retried.
    lost = decide(Ending(rc=-signal.SIGKILL, stop_why=None, **base))  # type: ignore[arg-type]
    assert lost is not None and (lost.outcome, lost.retryable) == ("lost", True)
    # Stopped because the store was out of reach: handed back, not counted.
    cut = decide(Ending(rc=75, stop_why=STOP_STORE_LOST, stopped=True, **base))  # type: ignore[arg-type]
    assert cut is not None and cut.outcome == "handed_back"
    # Stopped on its own when its lease went stale (a frozen worker): handed back too.
    lapsed = decide(Ending(rc=75, stop_why=None, stopped=True, lease_lapsed=True, **base))  # type: ignore[arg-type]
    assert lapsed is not None and lapsed.outcome == "handed_back"
    # Exit 75 with nobody asking (user code can exit 75): a counted failure, retried.
    forged = decide(Ending(rc=75, stop_why=None, stopped=True, **base))  # type: ignore[arg-type]
    assert forged is not None and (forged.outcome, forged.retryable) == ("failed", True)
    # A full disk is the storage's fault, not the job's: retried, never counted; but only
    # when the worker saw it full itself (user code can exit 5 too: tests/worker/
    # test_hostile_events.py).
    seen = {"storage_evidence": "the worker found 0.0 MiB free of 0.2 MiB"}
    for full in (
        Ending(rc=5, stop_why=None, **seen, **base),  # type: ignore[arg-type]
        Ending(
            rc=1, stop_why=None, error={"kind": "storage_full", "message": "ENOSPC"}, **seen, **base
        ),  # type: ignore[arg-type]
    ):
        d = decide(full)
        assert d is not None and d.outcome == "handed_back" and "storage full" in d.reason


@only("postgres")
def test_liveness_uses_the_database_clock(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heartbeats used to be stamped with each worker host's clock: 18 s of skew reaped a
    live worker. Now both the stamp and the reaper's cutoff come from the database."""
    from torchyard.store import models as store_models

    with session_scope(db_url) as s:
        make_worker(s, "w1")
    skewed = utcnow() - timedelta(seconds=120)  # this host's clock is two minutes late
    monkeypatch.setattr(store_models, "utcnow", lambda: skewed)
    with session_scope(db_url) as s:
        assert heartbeat(s, "w1") == "idle"
    with session_scope(db_url) as s:
        assert reap_stale_workers(s, 20) == []
        w = s.get(Worker, "w1")
        assert w is not None and abs((w.last_heartbeat - utcnow()).total_seconds()) < 5


def test_watchdog_refreshes_the_lease_only_while_it_can_vouch(tmp_path: Path) -> None:
    settings = _settings(f"sqlite:///{tmp_path / 'x.db'}", tmp_path, heartbeat_timeout_s=10.0)
    ctx = WorkerContext(settings, "w1", Device("cpu", None, "cpu", None), "127.0.0.1")
    dog = Watchdog(ctx)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        ctx.trainer = LocalTrainer(proc, tmp_path / "output.log", None)
        now = time.monotonic()
        ctx.store_ok_at = now
        os.utime(dog.lease_file, (0, 0))
        dog.check(now)
        assert time.time() - dog.lease_file.stat().st_mtime < 5  # refreshed
        os.utime(dog.lease_file, (0, 0))
        dog.check(now + 3.0)  # store silent 0.3 T: no refresh, trainer left alone
        assert dog.lease_file.stat().st_mtime == 0 and proc.poll() is None
        dog.check(now + 4.1)  # 0.41 T: SIGTERM, flagged as a store-lost stop
        assert proc.wait(timeout=5) == -signal.SIGTERM and ctx.store_lost_stop.is_set()
        ctx.store_ok_at, ctx.loop_beat = time.monotonic(), time.monotonic() - 3.0
        assert dog.loop_stalled(time.monotonic())  # a stuck supervision loop vouches for nothing
    finally:
        dog.stop()


def test_a_full_disk_at_launch_hands_the_job_back_uncounted(
    sqlite_url: str, tmp_path: Path, full_disk: Path
) -> None:
    """A full storage root used to fail the launch as a counted failure: a few minutes of
    full disk burned every restart of every job. Now it is handed back."""
    settings = _settings(sqlite_url, tmp_path, storage_root=full_disk)
    job_id, attempt_id, assignment_id = _started(sqlite_url)
    ctx = WorkerContext(settings, "w1", Device("cpu", None, "cpu", None), "127.0.0.1")
    Supervision(ctx, Claimed(assignment_id, attempt_id, 1, job_id, 0, 1, {"a": 1}, False)).run()
    with session_scope(sqlite_url) as s:
        att = s.get(Attempt, attempt_id)
        assert att is not None and att.state == "handed_back", att.reason
        assert att.reason is not None and att.reason.startswith("storage full")
        job = s.get(Job, job_id)
        assert job is not None and (job.state, job.attempt) == ("queued", 2)


class _SlowStore(MemoryStorage):
    """An object store whose uploads take a second each."""

    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        time.sleep(1.0)
        return super().write_file(key, path, move=move, sha256=sha256)


def test_a_launch_waits_for_the_checkpoints_an_earlier_attempt_left_to_go_up(
    db_url: str, tmp_path: Path
) -> None:
    """A chaos run found it: on an object store, attempt 2's launch, on the host where
    attempt 1 left a checkpoint it had not recorded, gave up at once while that checkpoint
    was going up ("1 checkpoint(s) still going up"), so the job was placed again and again
    and burnt its 100 restarts in seconds. The launch now waits for the upload, records the
    checkpoint and resumes from it."""
    settings = _settings(db_url, tmp_path)
    job_id, a1, _ = _started(db_url)
    run_dir = job_dir(settings.storage, job_id)
    (run_dir / "checkpoints").mkdir(parents=True)
    data = b"attempt 1's step 3"
    sha = hashlib.sha256(data).hexdigest()
    (run_dir / "checkpoints" / "s3.pt").write_bytes(data)
    ev = {"type": "checkpoint", "attempt": 1, "step": 3, "path": "checkpoints/s3.pt"}
    (run_dir / EVENTS_FILE).write_text(_line(**ev, bytes=len(data), sha256=sha))
    (run_dir / MARKER).write_text(json.dumps({"attempt": 1}))  # attempt 1 ran here
    with session_scope(db_url) as s:
        assert finish_attempt(s, a1, A_LOST, reason="worker lost") == "queued"
        make_worker(s, "w2")
        (d,) = schedule(s, heartbeat_timeout_s=10)
        a2 = s.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == 2)).one()
        claimed = Claimed(d.assignment_id, a2.id, 2, job_id, 0, 1, {}, False)
    sup = Supervision(
        WorkerContext(settings, "w2", Device("cpu", None, "cpu", None), "127.0.0.1"), claimed
    )
    store = _SlowStore(tmp_path / "scratch")
    sup.remote, sup.storage = True, store
    sup.uploads = sup.recorder.uploads = CheckpointUploads(store, settings.storage, job_id)
    began = time.monotonic()
    sup._ingest_backlog()  # no UploadPending: it waited
    assert time.monotonic() - began >= 1.0
    sup.uploads.close()
    with session_scope(db_url) as s:
        ck = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).one()
        assert (ck.path, ck.sha256) == ("checkpoints/s3.pt", sha)
        assert resume_pick(s, job_id, store) == "checkpoints/s3.pt"
