"""The launcher seam (worker/launcher.py): an in-memory launcher drives `Supervision` through
a whole assignment (so the supervisor talks only to the interface), and the local launcher
(worker/launch_local.py) reports exit codes and signals, kills a whole process group,
appends output to the log, and hands a one-rank job to a standby only when allowed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from proclib import alive
from sqlalchemy import select
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.jobs import request_cancel
from torchyard.store.models import Assignment, Attempt, Job, Metric
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, job_dir
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import LocalLauncher, LocalTrainer
from torchyard.worker.launch_sandbox import SandboxLauncher
from torchyard.worker.launcher import (
    DEFAULT_LAUNCHER,
    LAUNCHERS,
    Launcher,
    LaunchRequest,
    TrainerHandle,
    make_launcher,
)
from torchyard.worker.logpump import LogPump
from torchyard.worker.proc import Launch
from torchyard.worker.standby import Handed
from torchyard.worker.supervisor import WorkerContext, run_assignment

CPU = Device("cpu", None, "cpu", None)


class FakeTrainer:
    """A trainer that exists only in memory: it 'writes' its events at start, then exits
    with `rc` on its own, or with -SIGTERM once terminated when `rc` is None."""

    def __init__(self, request: LaunchRequest, rc: int | None):
        self.request, self.rc = request, rc
        self.calls: list[str] = []
        self.pid, self.log_path = 4242, request.log_path
        attempt = int(request.env.get("TORCHYARD_ATTEMPT", "1"))
        lines = [{"type": "started", "attempt": attempt, "step": 0}]
        lines += [
            {"type": "metric", "attempt": attempt, "step": i, "name": "train/loss", "value": 1 / i}
            for i in (1, 2)
        ]
        if rc == 0:
            lines.append({"type": "finished", "attempt": attempt, "step": 2})
        with open(request.cwd / EVENTS_FILE, "a") as f:
            f.writelines(json.dumps({"time": 1.0, **ev}) + "\n" for ev in lines)

    def poll(self) -> int | None:
        return self.rc

    def wait(self, timeout: float | None = None) -> int:
        assert self.rc is not None
        return self.rc

    def terminate(self) -> None:
        self.calls.append("terminate")
        self.rc = -signal.SIGTERM

    def kill(self) -> None:
        self.calls.append("kill")
        if self.rc is None:
            self.rc = -signal.SIGKILL

    def oom_killed(self) -> bool:
        return False


class FakeLauncher:
    name = "fake"

    def __init__(self, rc: int | None, on_start: Any = None):
        self.rc, self.on_start = rc, on_start
        self.started: list[FakeTrainer] = []

    def start(self, request: LaunchRequest) -> FakeTrainer:
        t = FakeTrainer(request, self.rc)
        self.started.append(t)
        if self.on_start is not None:
            self.on_start()
        return t


def _settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path)  # type: ignore[call-arg]


def _assign(db_url: str) -> tuple[str, int]:
    with session_scope(db_url) as s:
        make_worker(s, "w1")
        job = make_job(s)
        (d,) = schedule(s, heartbeat_timeout_s=10)
        return job.id, d.assignment_id


def test_the_launchers_and_handles_satisfy_the_protocols(tmp_path: Path) -> None:
    request = _request(tmp_path, "pass")
    assert isinstance(FakeLauncher(0), Launcher) and isinstance(LocalLauncher(), Launcher)
    assert isinstance(FakeTrainer(request, 0), TrainerHandle)
    local = LocalLauncher().start(request)
    assert isinstance(local, LocalTrainer) and isinstance(local, TrainerHandle)
    assert local.wait(timeout=30) == 0
    assert not isinstance(object(), TrainerHandle)


def test_a_fake_launcher_runs_an_assignment_to_success(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    job_id, assignment_id = _assign(sqlite_url)
    launcher = FakeLauncher(rc=0)
    pids: list[int] = []
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1", on_launch=pids.append)
    ctx.launcher = launcher
    assert run_assignment(ctx, assignment_id)
    (t,) = launcher.started
    run_dir = job_dir(settings.storage, job_id)
    req = t.request
    assert req.argv[1:3] == ["-m", "torchyard.trainer"] and req.cwd == run_dir
    assert req.log_path == run_dir / LOG_FILE and req.warm_ok  # one rank: a standby may take it
    assert req.env["TORCHYARD_ATTEMPT"] == "1"  # the slot's environment (worker/proc.py)
    assert req.sandbox_uid == settings.sandbox_uid + 1  # its owner's own (store/sandboxuids.py)
    assert json.loads(req.launch.spec_path.read_text())["batch_size"] == 64
    assert t.calls == ["kill"]  # whatever the trainer left in its group goes at the end
    assert pids == [4242] and ctx.trainer is None
    with session_scope(sqlite_url) as s:
        assert s.get(Job, job_id).state == "succeeded"  # type: ignore[union-attr]
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert (att.state, att.exit_code) == ("succeeded", 0)
        assert s.get(Assignment, assignment_id).pid == 4242  # type: ignore[union-attr]
        steps = s.scalars(select(Metric.step).where(Metric.job_id == job_id)).all()
        assert sorted(steps) == [1, 2]
    assert "===== torchyard: attempt 1, rank 0: trainer exited with code 0" in (
        (run_dir / LOG_FILE).read_text()
    )


def test_a_cancel_reaches_the_trainer_through_its_handle(sqlite_url: str, tmp_path: Path) -> None:
    settings = _settings(sqlite_url, tmp_path)
    job_id, assignment_id = _assign(sqlite_url)

    def cancel() -> None:
        with session_scope(sqlite_url) as s:
            request_cancel(s, s.get(Job, job_id))  # type: ignore[arg-type]

    launcher = FakeLauncher(rc=None, on_start=cancel)
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    ctx.launcher = launcher
    assert run_assignment(ctx, assignment_id)
    assert launcher.started[0].calls == ["terminate", "kill"]  # SIGTERM, then the group
    with session_scope(sqlite_url) as s:
        assert s.get(Job, job_id).state == "cancelled"  # type: ignore[union-attr]
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert (att.state, att.exit_code) == ("cancelled", -signal.SIGTERM)


def test_the_registry_names_both_launchers_and_the_setting_picks_one(tmp_path: Path) -> None:
    settings = _settings(f"sqlite:///{tmp_path / 'x.db'}", tmp_path)
    assert DEFAULT_LAUNCHER in LAUNCHERS
    local = make_launcher("local", settings)
    assert isinstance(local, LocalLauncher) and isinstance(local, Launcher)
    ctx = WorkerContext(settings, "w1", CPU, "127.0.0.1")
    assert isinstance(ctx.trainer_launcher(), SandboxLauncher)  # the default
    assert ctx.trainer_launcher() is ctx.trainer_launcher()  # one per slot
    off = WorkerContext(settings.model_copy(update={"sandbox": "off"}), "w1", CPU, "127.0.0.1")
    assert isinstance(off.trainer_launcher(), LocalLauncher)
    with pytest.raises(ValueError, match="unknown launcher 'nope'"):
        make_launcher("nope", settings)


def _request(tmp_path: Path, code: str, *, warm_ok: bool = False) -> LaunchRequest:
    return LaunchRequest(
        launch=Launch(tmp_path / "spec.json", tmp_path),
        argv=[sys.executable, "-c", code],
        env={"PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        log_path=tmp_path / LOG_FILE,
        warm_ok=warm_ok,
    )


def test_the_local_launcher_reports_exit_codes_and_appends_to_the_log(tmp_path: Path) -> None:
    (tmp_path / LOG_FILE).write_text("before\n")
    t = LocalLauncher().start(_request(tmp_path, "print('hello'); raise SystemExit(3)"))
    assert t.wait(timeout=30) == 3 and t.poll() == 3 and not t.oom_killed()
    assert t.log_path.read_text() == "before\nhello\n"
    t.terminate()  # after its end: nothing happens
    t.kill()


def test_terminate_reaches_the_leader_and_kill_the_whole_group(tmp_path: Path) -> None:
    # The leader ignores nothing; its child (a loader worker, a torchrun rank) sleeps on.
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(c.pid, flush=True); time.sleep(60)"
    )
    t = LocalLauncher().start(_request(tmp_path, code))
    assert t.poll() is None
    child = _pid_in_log(t.log_path)
    t.terminate()  # the leader only: a second SIGTERM must not reach the trainer's group
    assert t.wait(timeout=30) == -signal.SIGTERM
    assert alive(child)
    t.kill()  # the group: what the leader left behind goes too
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(child)


def _pid_in_log(log: Path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.endswith("\n"):
            return int(text.split()[0])
        time.sleep(0.01)
    raise AssertionError("the child's pid never reached the log")


class _Standby:
    def __init__(self, proc: subprocess.Popen[bytes] | None):
        self.proc = proc
        self.given: list[dict[str, object]] = []
        self.logs: list[Path] = []

    def hand_over(self, go: dict[str, object], log_path: Path) -> Handed | None:
        self.given.append(go)
        self.logs.append(log_path)
        if self.proc is None:
            return None
        r, w = os.pipe()
        os.close(w)
        return Handed(self.proc, LogPump(r, 1000))


def test_a_standby_takes_only_a_job_it_may_take(tmp_path: Path) -> None:
    warm = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    standby = _Standby(warm)
    launcher = LocalLauncher(standby)
    cold = launcher.start(_request(tmp_path, "raise SystemExit(7)"))  # warm_ok False
    assert standby.given == [] and cold.wait(timeout=30) == 7
    t = launcher.start(_request(tmp_path, "raise SystemExit(7)", warm_ok=True))
    assert t.pid == warm.pid and t.wait(timeout=30) == 0
    (go,) = standby.given
    assert standby.logs == [tmp_path / LOG_FILE] and go["env"] == {"PATH": "/usr/bin:/bin"}
    empty = LocalLauncher(_Standby(None))  # none ready: a cold start
    assert empty.start(_request(tmp_path, "raise SystemExit(7)", warm_ok=True)).wait(30) == 7
