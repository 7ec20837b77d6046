"""The warm trainer (worker/standby.py, trainer/standby.py), with real processes on CPU: a
job run by the slot's standby ends exactly as a cold trainer's; the standby dies with its
parent, exits 0 on end of input, refuses a bad go message with the bad-spec exit code, is
never handed a job under another environment, and SIGTERM to its process group during the
job still ends with a checkpoint."""

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
from proclib import assert_dies_with_parent
from sqlalchemy import select
from support.worker_factories import DIGITS_SPEC, make_job, make_worker, warm_for

from torchyard.contracts import exitcodes
from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Attempt, Job
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, job_dir
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import signal_group, spawn
from torchyard.worker.launcher import Launcher, choose_launcher
from torchyard.worker.proc import Launch, go_message, slot_env, standby_argv
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.supervisor import WorkerContext, run_assignment

CPU = Device("cpu", None, "cpu", None)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")


def _settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path, trainer_threads=1)  # type: ignore[call-arg]


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _warm(settings: Settings) -> WarmTrainer:
    return WarmTrainer(lambda: slot_env(settings, CPU.cuda_visible, {}))


def _run_job(
    settings: Settings,
    db_url: str,
    wid: str,
    warm: WarmTrainer | None,
    launcher: Launcher | None = None,
) -> dict:
    """Schedule one digits job onto worker `wid` and run it to its end here."""
    with session_scope(db_url) as s:
        make_worker(s, wid)
        job = make_job(s, name=wid)
        (d,) = schedule(s, heartbeat_timeout_s=10)
        job_id = job.id
    pids: list[int] = []
    ctx = WorkerContext(
        settings, wid, CPU, "127.0.0.1", on_launch=pids.append, warm=warm, launcher=launcher
    )
    assert run_assignment(ctx, d.assignment_id)
    with session_scope(db_url) as s:
        att = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        asg = s.get(Assignment, d.assignment_id)
        assert asg is not None
        run_dir = job_dir(settings.storage, job_id)
        return {
            "job": s.get(Job, job_id).state,  # type: ignore[union-attr]
            "attempt": (att.state, att.exit_code),
            "rc": asg.exit_code,
            "pid": pids[0],
            "events": [  # `progress` comes on a timer: not comparable
                (e["type"], e.get("step"), e.get("name"), e.get("attempt"))
                for e in _events(run_dir / EVENTS_FILE)
                if e["type"] != "progress"
            ],
            "log": (run_dir / LOG_FILE).read_text(),
        }


def test_a_job_on_the_warm_trainer_ends_exactly_as_on_a_cold_one(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = _settings(sqlite_url, tmp_path)
    warm = _warm(settings)
    launcher = choose_launcher(settings, warm)  # before the standby starts: it says how
    warm_for(launcher, settings, sqlite_url)  # a zygote serves one user: the job's
    warm.refill()
    assert warm.proc is not None
    standby_pid = warm.proc.pid
    try:
        w = _run_job(settings, sqlite_url, "w1", warm, launcher)
    finally:
        warm.close()
    c = _run_job(settings, sqlite_url, "w2", None)
    zygote = getattr(launcher, "_zygote", None)
    if zygote is not None:  # the sandbox's warm trainer ran it in a fork (worker/zygote.py)
        assert zygote.proc.pid == standby_pid and zygote.rc == 0, "not run on the standby"
        assert w["pid"] != standby_pid  # the fork's pid is recorded
    else:
        assert w["pid"] == standby_pid, "the job did not run on the standby"
    assert warm.proc is None  # taken, until the worker's refill (a zygote comes back then)
    assert w["job"] == c["job"] == "succeeded"
    assert w["attempt"] == c["attempt"] == ("succeeded", 0)
    assert w["rc"] == c["rc"] == 0
    assert w["events"] == c["events"]
    assert {e[0] for e in w["events"]} >= {"started", "metric", "finished"}
    assert {e[3] for e in w["events"]} == {1}  # the per-job TORCHYARD_ATTEMPT reached it
    for log in (w["log"], c["log"]):  # the worker's marker, then the trainer's own head
        assert "===== torchyard: attempt 1" in log and "environment: " in log


@linux_only
def test_the_standby_dies_with_its_parent(tmp_path: Path) -> None:
    # A parent (the worker's code) that starts a standby, says its pid, then waits.
    code = (
        "import os, sys, time; from pathlib import Path; "
        "from torchyard.worker.standby import WarmTrainer; "
        "w = WarmTrainer(lambda: {**os.environ, 'TORCHYARD_DIE_WITH_PARENT': '1'}, Path('.')); "
        "w.refill(); print(w.proc.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert_dies_with_parent(parent, child, "standby")


def test_end_of_input_exits_0_and_close_reaps(sqlite_url: str, tmp_path: Path) -> None:
    warm = _warm(_settings(sqlite_url, tmp_path))
    warm.refill()
    proc = warm.proc
    assert proc is not None and proc.stdin is not None
    proc.stdin.close()  # what close() does, waited for without its kill fallback
    assert proc.wait(timeout=120) == 0
    warm.refill()  # the dead one is replaced ...
    assert warm.proc is not None and warm.proc is not proc
    second = warm.proc
    warm.close()  # ... and a stopping worker reaps it
    assert warm.proc is None and second.returncode is not None


def _standby_with_log(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "standby.out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = spawn(standby_argv(), env=env, cwd=tmp_path, log_fd=fd, stdin=subprocess.PIPE)
    finally:
        os.close(fd)
    return proc, out


@pytest.mark.parametrize(
    "message",
    [b"not json\n", b'{"spec": "relative.json", "run_dir": "/r", "env": {}, "log": "/l"}\n'],
)
def test_a_bad_go_message_exits_bad_spec(sqlite_url: str, tmp_path: Path, message: bytes) -> None:
    env = slot_env(_settings(sqlite_url, tmp_path), CPU.cuda_visible, {})
    proc, out = _standby_with_log(tmp_path, env)
    assert proc.stdin is not None
    proc.stdin.write(message)
    proc.stdin.close()
    assert proc.wait(timeout=120) == exitcodes.BAD_SPEC
    assert "trainer --standby: bad go message" in out.read_text()


def test_a_standby_started_for_another_environment_is_not_used(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = _settings(sqlite_url, tmp_path)
    warm = _warm(settings)
    warm.refill()
    proc = warm.proc
    assert proc is not None
    launch = Launch(spec_path=tmp_path / "spec.json", run_dir=tmp_path)
    env = slot_env(settings, CPU.cuda_visible, {}, attempt=1)
    env["OMP_NUM_THREADS"] = "7"  # read at import: the standby's would be wrong
    assert warm.hand_over(go_message(launch, env, tmp_path / LOG_FILE), tmp_path / LOG_FILE) is None
    assert proc.returncode is not None and warm.proc is None


def test_sigterm_to_the_group_during_a_warm_job_checkpoints(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = _settings(sqlite_url, tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = run_dir / "spec.json"
    spec.write_text(json.dumps({**DIGITS_SPEC, "epochs": 100_000}))
    warm = _warm(settings)
    warm.refill()
    env = slot_env(settings, CPU.cuda_visible, {}, attempt=1)
    handed = warm.hand_over(
        go_message(Launch(spec, run_dir), env, run_dir / LOG_FILE), run_dir / LOG_FILE
    )
    assert handed is not None
    proc = handed.proc
    try:
        events = run_dir / EVENTS_FILE
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if events.exists() and any(e["type"] == "metric" for e in _events(events)):
                break
            time.sleep(0.02)
        assert proc.poll() is None, (run_dir / LOG_FILE).read_text()
        signal_group(proc, signal.SIGTERM)  # as the supervisor's group signal reaches it
        assert proc.wait(timeout=120) == exitcodes.PREEMPTED
    finally:
        signal_group(proc, signal.SIGKILL)
        proc.wait()
    (stopped,) = [e for e in _events(events) if e["type"] == "stopped"]
    assert stopped["signal"] == "SIGTERM" and (run_dir / stopped["checkpoint"]).is_file()


@pytest.mark.parametrize("on", [True, False])
def test_the_setting_turns_the_warm_trainer_off(sqlite_url: str, tmp_path: Path, on: bool) -> None:
    from torchyard.worker.node import WorkerNode

    settings = Settings(_env_file=None, database_url=sqlite_url, home=tmp_path, warm_trainer=on)  # type: ignore[call-arg]
    node = WorkerNode(settings, "w1", CPU, "127.0.0.1")
    assert isinstance(node.ctx.warm, WarmTrainer) if on else node.ctx.warm is None
    assert node.ctx.warm is None or node.ctx.warm.proc is None  # started by run(), not here
