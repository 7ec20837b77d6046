"""Issue 25, "A careless script wedges a worker for good" and "User code can forge the
worker's judgements": what a job's code writes cannot wedge its worker or claim a fault of
the host. Each attack is driven with crafted events.jsonl lines (no trainer), or with a
small real process behind the local launcher; the end-to-end versions with a real script
job are in test_hostile_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc, select
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_worker

from torchyard.contracts.eventmodel import EventLimits, event_problem, parse_event_line
from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.ingest import refused_by_store
from torchyard.store.jobs import request_cancel
from torchyard.store.lifecycle import finish_attempt
from torchyard.store.metrics import ingest_metrics, metric_names
from torchyard.store.models import Attempt, Checkpoint, Job, Metric, utcnow
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, job_dir
from torchyard.store.queue import queue_heads
from torchyard.store.states import A_HANDED_BACK
from torchyard.worker import supervisor
from torchyard.worker.events import EventRecorder, EventTail
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import LocalLauncher
from torchyard.worker.launcher import LaunchRequest, TrainerHandle
from torchyard.worker.outcome import Ending, decide
from torchyard.worker.runlimits import dir_bytes, run_dir_over
from torchyard.worker.supervisor import WorkerContext, run_assignment
from torchyard.worker.watchdog import Watchdog

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

pytestmark = pytest.mark.hostile
CPU = Device("cpu", None, "cpu", None)


def _line(**ev: Any) -> bytes:
    return (json.dumps({"time": 1.0, **ev}) + "\n").encode()


def _settings(db_url: str, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path, **kw)  # type: ignore[call-arg]


def _placed(s: Session, **job_kw: Any) -> tuple[Job, Attempt, int]:
    """A job the scheduler placed on worker w1: (job, its attempt, the assignment id)."""
    make_worker(s, "w1")
    job = make_job(s, **job_kw)
    (d,) = schedule(s, heartbeat_timeout_s=10)
    s.commit()
    attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    return job, attempt, d.assignment_id


def _recorder(s: Session, **kw: Any) -> EventRecorder:
    job, attempt, _ = _placed(s)
    return EventRecorder(job.id, attempt.id, attempt.number, **kw)


def _tx(db_url: str) -> Any:
    def tx(fn: Any) -> Any:
        with session_scope(db_url) as s:
            return fn(s)

    return tx


# ---- the store: no statement shaped by user-chosen counts -----------------------------------


def test_a_batch_of_3000_new_metric_names_is_written(session: Session) -> None:
    """3,000 new names in one flush built a 3,000-column SELECT (SQLite allows 2,000,
    PostgreSQL 1,664) and the worker retried it forever; now names go 500 per statement,
    one row per name."""
    s = session
    job, _, _ = _placed(s)
    rows = [
        {"name": f"m/{i:04d}", "step": step, "value": float(i), "time": 1.0}
        for step in (1, 2)
        for i in range(3000)
    ]
    assert ingest_metrics(s, job.id, rows[:3000]) == 3000  # every series new
    assert ingest_metrics(s, job.id, rows) == 6000  # step 1 replayed, step 2 new
    s.commit()
    assert len(metric_names(s, job.id)) == 3000
    assert metric_names(s, job.id, limit=10) == [f"m/{i:04d}" for i in range(10)]
    assert s.query(Metric).count() == 6000


def test_what_the_store_refuses_is_told_from_an_outage() -> None:
    class Orig(Exception):
        def __init__(self, msg: str, sqlstate: str | None = None):
            super().__init__(msg)
            self.sqlstate = sqlstate

    def op(msg: str, sqlstate: str | None = None, lost: bool = False) -> exc.DBAPIError:
        return exc.OperationalError("stmt", {}, Orig(msg, sqlstate), connection_invalidated=lost)

    assert refused_by_store(op("too many columns on result set"))  # SQLite's limit
    assert refused_by_store(op("target lists can have at most 1664 entries", "54011"))
    assert refused_by_store(exc.DataError("stmt", {}, Orig("out of range", "22003")))
    assert refused_by_store(OverflowError("Python int too large to convert to SQLite INTEGER"))
    assert not refused_by_store(op("database is locked"))  # SQLite: retried
    assert not refused_by_store(op("terminating connection", "57P01"))  # PostgreSQL: retried
    assert not refused_by_store(op("server closed the connection", lost=True))
    assert not refused_by_store(ConnectionError("store down"))


# ---- every line checked before it reaches the store ----------------------------------------


HOSTILE_LINES = [
    (_line(type="metric", step=2**64, name="loss", value=1.0), "step"),
    (_line(type="metric", step=-1, name="loss", value=1.0), "step"),
    (_line(type="metric", step=1, name="x" * 101, value=1.0), "metric name of 101"),
    (_line(type="metric", step=1, name="a\u0000b", value=1.0), "NUL"),
    (_line(type="metric", step=1, name="a\nb", value=1.0), "control characters"),
    (_line(type="metric", step=1, name="big", value=10**400), "finite"),
    (_line(type="metric", step=1, name="sys/gpu_util_percent", value=0.0), "system metrics"),
    (_line(type="progress", step=1, eta_s=1, total_steps=2**70), "total_steps"),
    (_line(type="checkpoint", step=1, path="../other-job/x.pt", sha256="a" * 64), "inside"),
    (_line(type="checkpoint", step=1, path="/etc/passwd", sha256="a" * 64), "relative"),
    (_line(type="checkpoint", step=1, path="c/x.pt", sha256="nothex"), "sha256"),
    (_line(type="checkpoint", step=1, path="c/x.pt", kind="bogus"), "kind"),
    (_line(type="checkpoint", step=1, path="c/x.pt", attempt=2**40), "attempt"),
    (_line(type="error", kind="host_on_fire", message="x"), "error kind"),
    (b'{"type": "metric", "step": 1, "name": "pad", "value": 1, "x": "' + b"p" * 70_000 + b'"}\n',
     "TORCHYARD_MAX_EVENT_LINE_BYTES"),
    (b"not json at all\n", "not a valid event"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "why"), HOSTILE_LINES, ids=[w for _, w in HOSTILE_LINES])
def test_a_hostile_line_is_set_aside_and_the_rest_recorded(
    sqlite_url: str, tmp_path: Path, line: bytes, why: str
) -> None:
    """Steps, names, values, checkpoint fields and error kinds from events.jsonl used to
    reach the store unchecked: a step of 2**64 raised OverflowError in the worker, forever.
    Now the line is set aside (counted, in the job log and the attempt's reason) and the
    lines around it are recorded."""
    p = tmp_path / EVENTS_FILE
    good = _line(type="metric", attempt=1, step=1, name="loss", value=0.5)
    p.write_bytes(good + line + _line(type="started", attempt=1, step=0) + good)
    with session_scope(sqlite_url) as s:
        rec = _recorder(s)
    tail = EventTail(p)
    rec.add_all(tail)
    assert rec.set_aside.count == 1 and why in (rec.set_aside.first or ""), rec.set_aside
    rec.commit(_tx(sqlite_url))
    with session_scope(sqlite_url) as s:
        att = s.get(Attempt, rec.attempt_id)
        assert att is not None and att.state == "running"  # the start went through
        assert att.events_offset == p.stat().st_size  # never read again
        assert att.reason is not None and "1 event line(s) set aside" in att.reason
        assert s.query(Metric).count() == 1 and s.query(Checkpoint).count() == 0
    assert why in "".join(rec.set_aside.take_log_lines())


def test_a_line_without_end_is_dropped_as_it_comes_not_held(tmp_path: Path) -> None:
    """A script that writes one endless line used to grow the worker's buffer without
    bound; now past the line limit it is dropped up to its newline and reported once."""
    p = tmp_path / EVENTS_FILE
    tail = EventTail(p, max_line=1024)
    with p.open("ab") as f:
        f.write(b'{"type": "metric", "x": "' + b"y" * 5000)
        f.flush()
        assert tail.read() == [] and len(tail._partial) == 0 and tail.bad == []
        f.write(b"z" * 5000 + b'"}\n' + _line(type="started"))
    assert [e.type for e in tail.read()] == ["started"]
    assert len(tail.take_bad()) == 1 and tail.consumed == p.stat().st_size


def test_a_job_holds_at_most_its_limit_of_metric_names(db_url: str, tmp_path: Path) -> None:
    """Names past TORCHYARD_MAX_METRIC_NAMES (across attempts) are set aside; the others
    keep being recorded."""
    with session_scope(db_url) as s:
        rec = _recorder(s, limits=EventLimits(metric_names=50))
    p = tmp_path / EVENTS_FILE
    p.write_bytes(b"".join(_line(type="metric", step=1, name=f"n{i:04d}", value=1.0)
                           for i in range(3000)))  # fmt: skip
    tail = EventTail(p)
    while rec.add_all(tail, limit=700):
        rec.commit(_tx(db_url))
    rec.add(parse_event_line(_line(type="metric", step=2, name="n0000", value=2.0)))
    rec.commit(_tx(db_url))
    assert rec.set_aside.count == 2950
    with session_scope(db_url) as s:
        assert len(metric_names(s, rec.job_id)) == 50
        assert s.query(Metric).count() == 51
        att = s.get(Attempt, rec.attempt_id)
        assert att is not None and "2950 event line(s) set aside" in (att.reason or "")
    logged = "".join(rec.set_aside.take_log_lines())
    assert logged.count("set aside:") == 50 and "2900 more event lines set aside" in logged


def test_a_batch_the_store_refuses_is_set_aside_not_retried(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch the store refused used to be retried forever. Now its points are set aside,
    and the rest of the batch (the start, a checkpoint, the offset) is still written."""
    with session_scope(db_url) as s:
        rec = _recorder(s)
    calls = {"n": 0}

    def refuse(*_: Any, **__: Any) -> None:
        calls["n"] += 1
        raise exc.OperationalError("SELECT …", {}, Exception("too many columns on result set"))

    monkeypatch.setattr("torchyard.worker.events.ingest_metrics", refuse)
    for ev in (
        _line(type="started", attempt=1, step=0),
        *(_line(type="metric", attempt=1, step=i, name="loss", value=1.0) for i in range(5)),
        _line(type="checkpoint", attempt=1, step=4, path="checkpoints/a.pt", bytes=1, sha256="b" * 64),
    ):  # fmt: skip
        rec.add(parse_event_line(ev))
    rec.offset = 1234
    rec.commit(_tx(db_url))
    assert calls["n"] == 1 and rec.pending == 0 and rec.set_aside.count == 5
    with session_scope(db_url) as s:
        att = s.get(Attempt, rec.attempt_id)
        assert att is not None and (att.state, att.events_offset) == ("running", 1234)
        assert [c.path for c in s.scalars(select(Checkpoint))] == ["checkpoints/a.pt"]

    def lost(*_: Any, **__: Any) -> None:
        raise exc.OperationalError("x", {}, Exception("closed"), connection_invalidated=True)

    monkeypatch.setattr("torchyard.worker.events.ingest_metrics", lost)
    rec.add(parse_event_line(_line(type="metric", attempt=1, step=9, name="loss", value=1.0)))
    with pytest.raises(exc.OperationalError):  # an outage: kept, retried by the caller
        rec.commit(_tx(db_url))
    assert len(rec.metrics) == 1 and rec.set_aside.count == 5


# ---- cancel and SIGTERM end a job whose ingest fails ---------------------------------------

# Writes what the review's scripts wrote, in one flush, then waits; exits 75 on SIGTERM.
HOSTILE_SCRIPT = """
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
lines = [{"type": "started", "attempt": 1, "step": 0}]
lines += [{"type": "metric", "attempt": 1, "step": 1, "name": f"m{i}", "value": 1.0}
          for i in range(3000)]
lines += [{"type": "metric", "attempt": 1, "step": 2**64, "name": "loss", "value": 1.0}]
with open("events.jsonl", "a") as f:
    f.write("".join(json.dumps(ev) + "\\n" for ev in lines))
print("written", flush=True)
while True:
    time.sleep(0.05)
"""


class ScriptLauncher:
    """The local launcher running `code` instead of the trainer (cold, no standby)."""

    name = "script"

    def __init__(self, code: str):
        self.code = code
        self.started: list[TrainerHandle] = []

    def start(self, request: LaunchRequest) -> TrainerHandle:
        argv = [sys.executable, "-c", self.code]
        t = LocalLauncher().start(dataclasses.replace(request, argv=argv, warm_ok=False))
        self.started.append(t)
        return t


def _run_in_thread(ctx: WorkerContext, assignment_id: int) -> threading.Thread:
    t = threading.Thread(target=run_assignment, args=(ctx, assignment_id), daemon=True)
    t.start()
    return t


def _wait(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _job_state(db_url: str, job_id: str) -> str:
    with session_scope(db_url) as s:
        return s.get(Job, job_id).state  # type: ignore[union-attr]


def _hostile_worker(
    settings: Settings, url: str
) -> tuple[str, WorkerContext, threading.Thread, Path]:
    """A placed job run by a worker thread with HOSTILE_SCRIPT as its trainer, once the
    script's first flush is in its log: (job id, the worker's context, its thread, the log)."""
    with session_scope(url) as s:
        job, _, assignment_id = _placed(s)
        job_id = job.id
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    ctx.launcher = ScriptLauncher(HOSTILE_SCRIPT)
    worker = _run_in_thread(ctx, assignment_id)
    log = job_dir(settings.storage, job_id) / LOG_FILE
    _wait("the script's flush", lambda: log.exists() and "written" in log.read_text(), 60)
    return job_id, ctx, worker, log


@pytest.mark.parametrize("ingest", ["hostile lines", "store refusing every batch"])
def test_cancel_ends_the_job_within_seconds_however_ingest_fails(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ingest: str
) -> None:
    """The job stayed `cancelling` after a 202 cancel while its worker retried a batch
    forever; now it is `cancelled` within seconds and the worker is free."""
    if ingest != "hostile lines":

        def refuse(*_: Any, **__: Any) -> None:
            raise exc.DataError("INSERT …", {}, Exception("value out of range"))

        monkeypatch.setattr("torchyard.worker.events.ingest_metrics", refuse)
    settings = _settings(db_url, tmp_path, cancel_grace_s=1.0)
    job_id, _, worker, log = _hostile_worker(settings, db_url)
    time.sleep(1.0)  # a few flushes
    t0 = time.monotonic()
    with session_scope(db_url) as s:
        request_cancel(s, s.get(Job, job_id))  # type: ignore[arg-type]
    worker.join(timeout=10)
    assert not worker.is_alive() and time.monotonic() - t0 < 10
    assert _job_state(db_url, job_id) == "cancelled"
    with session_scope(db_url) as s:
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert att.reason is not None and "set aside" in att.reason, att.reason
    assert "event line set aside" in log.read_text()


def test_sigterm_ends_the_worker_within_its_stop_deadline_while_ingest_is_down(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose ingest failed ignored SIGTERM (only SIGKILL freed the slot): the
    trainer's last events were retried forever. Now a stopping worker gives the store up
    STOP_DEADLINE_S after its SIGTERM; the lines stay past the committed offset for the
    next attempt."""
    monkeypatch.setattr(supervisor, "STOP_DEADLINE_S", 3.0)

    def down(*_: Any, **__: Any) -> None:
        raise exc.OperationalError("x", {}, Exception("closed"), connection_invalidated=True)

    monkeypatch.setattr("torchyard.worker.events.ingest_metrics", down)
    settings = _settings(sqlite_url, tmp_path)
    job_id, ctx, worker, _ = _hostile_worker(settings, sqlite_url)
    t0 = time.monotonic()
    ctx.stopping.set()  # what the worker's SIGTERM does
    worker.join(timeout=15)
    assert not worker.is_alive() and time.monotonic() - t0 < 10
    with session_scope(sqlite_url) as s:
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert att.state == "handed_back" and att.events_offset < 1000


# ---- only the worker decides that a failure is the host's ----------------------------------

FORGED_FULL_DISK = """
import json, sys
with open("events.jsonl", "a") as f:
    f.write(json.dumps({"type": "error", "attempt": %d, "kind": "storage_full",
                        "message": "No space left on device (honest)"}) + "\\n")
sys.exit(5)
"""


def test_an_exit_5_or_a_storage_full_event_from_user_code_is_counted(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A script that exits 5 (or writes an error of kind storage_full) was handed back
    uncounted: 15 attempts in a minute with max_restarts 1. Now the worker looks at the
    run directory's file system itself; with room there, it is an ordinary failure."""
    settings = _settings(sqlite_url, tmp_path)
    with session_scope(sqlite_url) as s:
        job, _, assignment_id = _placed(s, max_restarts=1)
        job_id = job.id
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    for n in (1, 2):
        ctx.launcher = ScriptLauncher(FORGED_FULL_DISK % n)
        assert run_assignment(ctx, assignment_id)
        with session_scope(sqlite_url) as s:
            make_worker_idle(s)
            state = s.get(Job, job_id).state  # type: ignore[union-attr]
            if n == 1:
                assert state == "queued"
                (d,) = schedule(s, heartbeat_timeout_s=10)
                assignment_id = d.assignment_id
    with session_scope(sqlite_url) as s:
        j = s.get(Job, job_id)
        assert j is not None and j.state == "failed", j.state
        atts = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).all()
        assert [a.state for a in atts] == ["failed", "failed"]
        assert "reported a full storage" in (atts[0].reason or "")
        assert "free on the run directory's file system" in (atts[0].reason or "")
    for rc, error in ((5, None), (1, {"kind": "storage_full", "message": "ENOSPC"})):
        base = {"rank": 0, "worker_id": "w", "job_state": "running", "stop_why": None}
        d = decide(Ending(rc=rc, error=error, **base))  # type: ignore[arg-type]
        assert d is not None and (d.outcome, d.retryable) == ("failed", True)


def make_worker_idle(s: Session) -> None:
    from torchyard.store.models import Worker

    w = s.get(Worker, "w1")
    assert w is not None
    w.state, w.current_job_id = "idle", None


def test_a_full_disk_the_worker_sees_still_hands_back(
    sqlite_url: str, tmp_path: Path, full_disk: Path
) -> None:
    """The built-in trainer's exit 5 on a really full disk keeps handing the job back:
    the worker finds the file system full itself."""
    settings = _settings(sqlite_url, tmp_path, storage_root=full_disk)
    with session_scope(sqlite_url) as s:
        job, _, assignment_id = _placed(s, max_restarts=0)
        job_id = job.id
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    ctx.launcher = ScriptLauncher("import sys; sys.exit(5)")
    try:
        assert run_assignment(ctx, assignment_id)
    except OSError:  # pragma: no cover - the spec file itself may not fit
        pytest.skip("the full disk left no room for the spec")
    with session_scope(sqlite_url) as s:
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert att.state == "handed_back", att.reason
        assert "storage full" in (att.reason or "")


def test_a_job_handed_back_again_and_again_backs_off(session: Session) -> None:
    """Hand-backs are not counted; one that repeats now waits longer each time before a
    pass may start the job again, and its pending reason says why."""
    s = session
    job, attempt, _ = _placed(s)
    holds = []
    for n in range(1, 6):
        assert finish_attempt(s, attempt.id, A_HANDED_BACK, reason="storage full") == "queued"
        s.commit()
        s.refresh(job)
        holds.append(job.hold_until)
        if n <= 2:
            assert job.hold_until is None and job.pending_reason == "handed back: storage full"
            make_worker_idle(s)
            (d,) = schedule(s, heartbeat_timeout_s=10)  # at once
        else:
            assert job.hold_until is not None and job.hold_until > utcnow()
            wait = 5 * 2 ** (n - 3)  # 5 s, then doubling
            assert (
                f"handed back {n} times in a row; backing off: not started again for {wait}s"
                in (job.pending_reason or "")
            )
            assert queue_heads(s, 10) == []  # a pass waits
            assert [q.id for q in queue_heads(s, 10, lock=False)] == [job.id]  # still shown
            job.hold_until = utcnow()  # the wait is over
            s.commit()
            make_worker_idle(s)
            (d,) = schedule(s, heartbeat_timeout_s=10)
        s.commit()
        attempt = s.scalars(
            select(Attempt).where(Attempt.job_id == job.id, Attempt.number == n + 1)
        ).one()
        assert d.job_id == job.id
    assert [h is None for h in holds] == [True, True, False, False, False]


# ---- the run directory's size ---------------------------------------------------------------

BIG_SAVE = """
import torch
import torchyard.job as job
job.save({"w": torch.zeros(int(1.1 * 2**30) // 4)}, 1)
print("saved", flush=True)
"""


def test_a_1_1_gib_save_over_the_run_dir_limit_fails_the_job_as_run_dir_full(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A 1.1 GiB job.save used to be kept; over TORCHYARD_MAX_RUN_DIR_BYTES the job now
    fails with its own error kind, not as a storage fault of the host."""
    settings = _settings(sqlite_url, tmp_path, max_run_dir_bytes=64 * 1024**2)
    with session_scope(sqlite_url) as s:
        job, _, assignment_id = _placed(s)
        job_id = job.id
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    ctx.launcher = ScriptLauncher(BIG_SAVE)
    assert run_assignment(ctx, assignment_id)
    with session_scope(sqlite_url) as s:
        j = s.get(Job, job_id)
        assert j is not None and j.state == "failed"
        assert j.error is not None and j.error.startswith("run_dir_full: ")
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert att.state == "failed" and "TORCHYARD_MAX_RUN_DIR_BYTES" in (att.reason or "")
    for f in job_dir(settings.storage, job_id).rglob("*"):  # 1.1 GiB: not kept by tests
        if f.is_file() and f.stat().st_size > 2**20:
            f.unlink()


def test_the_disk_watch_kills_a_trainer_whose_run_dir_grows_over_the_limit(
    tmp_path: Path,
) -> None:
    settings = _settings(f"sqlite:///{tmp_path / 'x.db'}", tmp_path, max_run_dir_bytes=2**20)
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    dog = Watchdog(ctx)
    run_dir = tmp_path / "run"
    (run_dir / "sub").mkdir(parents=True)
    request = LaunchRequest(
        launch=supervisor.Launch(tmp_path / "spec.json", run_dir),
        argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        env={"PATH": "/usr/bin:/bin"},
        cwd=run_dir,
        log_path=run_dir / LOG_FILE,
    )
    ctx.trainer, ctx.watch_dir = LocalLauncher().start(request), run_dir
    try:
        (run_dir / "sub" / "a").write_bytes(b"x" * 2**19)
        (run_dir / "link").symlink_to("/usr")  # a link is not followed
        dog.check_disk()
        assert ctx.run_dir_full is None and ctx.trainer.poll() is None
        (run_dir / "sub" / "b").write_bytes(b"x" * 2**19 + b"x")
        dog.check_disk()
        assert ctx.run_dir_full is not None and "TORCHYARD_MAX_RUN_DIR_BYTES" in ctx.run_dir_full
        assert ctx.trainer.wait(timeout=10) == -signal.SIGKILL
    finally:
        ctx.trainer.kill()
        dog.stop()
    assert dir_bytes(run_dir) > 2**20 and run_dir_over(run_dir, 2**21) is None


def test_event_problem_takes_what_an_honest_trainer_writes() -> None:
    for ev in (
        {"type": "metric", "step": 3, "name": "train/loss", "value": None, "attempt": 2},
        {"type": "metric", "step": 3, "name": "val/acc", "value": -1.5, "epoch": 0.5},
        {"type": "checkpoint", "step": 3, "path": "checkpoints/step-00000003.pt",
         "bytes": 10, "sha256": "ab" * 32, "kind": "resume", "pruned": ["checkpoints/x.pt"]},
        {"type": "error", "kind": "storage_full", "message": "No space left", "rank": 1},
        {"type": "finished", "step": 3, "metrics": {"val/loss": -0.5, "x": None}},
        {"type": "started", "versions": {"torch": "2.5"}, "world_size": 2, "pid": 4242},
    ):  # fmt: skip
        assert event_problem(parse_event_line(json.dumps(ev))) is None, ev
