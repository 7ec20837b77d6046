"""The worker's warm mark (workers.warm_since, worker/node.py): set once its standby has
said it is ready (trainer/standby.py READY_LINE, seen by worker/standby.py ReadyPump),
cleared when a job takes the standby (and while the next one imports) or when it dies,
never set with TORCHYARD_WARM_TRAINER=false or under a launcher that starts every trainer
cold; and a scheduling pass gives the job to the warm worker of two real ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from support.backends import only
from support.worker_factories import DIGITS_SPEC, make_job, warm_for

from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Job, Worker
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import spawn
from torchyard.worker.launch_sandbox import SandboxLauncher
from torchyard.worker.launcher import uses_standby
from torchyard.worker.node import WorkerNode
from torchyard.worker.proc import Launch, go_message
from torchyard.worker.sandbox import Support, support
from torchyard.worker.standby import READY_LINE, ReadyPump, Starter

CPU = Device("cpu", None, "cpu", None)
QUICK = {**DIGITS_SPEC, "epochs": 1, "max_steps": 3}


def _settings(db_url: str, home: Path, **kw: object) -> Settings:
    kw.setdefault("sandbox", "on" if support().ok else "off")  # a standby it uses either way
    return Settings(_env_file=None, database_url=db_url, home=home, trainer_threads=1, **kw)  # type: ignore[call-arg]


def _warm_since(db_url: str, wid: str) -> datetime | None:
    with session_scope(db_url) as s:
        return s.scalar(select(Worker.warm_since).where(Worker.id == wid))


def _until(cond: Callable[[], object], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_both_sides_agree_on_the_ready_line() -> None:
    from torchyard.trainer import standby as trainer_standby

    assert trainer_standby.READY_LINE == READY_LINE


def test_the_pump_takes_the_ready_line_out_until_the_hand_over(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    r, w = os.pipe()
    pump = ReadyPump(r, 10_000)
    os.write(w, b"an import warning\n" + READY_LINE)
    _until(pump.ready.is_set, "the ready line")
    log = tmp_path / "output.log"
    pump.retarget(log)  # a job's now: its output is never looked into
    os.write(w, READY_LINE)
    os.close(w)
    pump.join(10)
    assert pump.ended.is_set()
    err = capfd.readouterr().err
    assert "an import warning" in err and READY_LINE.decode() not in err
    assert log.read_bytes() == READY_LINE


def test_a_worker_without_a_usable_standby_is_never_warm(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = WorkerNode(_settings(sqlite_url, tmp_path, warm_trainer=False), "off", CPU, "x")
    off.register()
    for _ in range(3):
        off.heartbeat_tick()
    assert off.ctx.warm is None and not off.warm_now()
    assert _warm_since(sqlite_url, "off") is None
    # A host that cannot sandbox starts every trainer cold: its ready standby does not count.
    monkeypatch.setattr(
        "torchyard.worker.launch_sandbox.support", lambda: Support(False, "no bwrap here")
    )
    node = WorkerNode(_settings(sqlite_url, tmp_path / "n", sandbox="on"), "nobwrap", CPU, "x")
    assert isinstance(node.ctx.launcher, SandboxLauncher)
    assert not uses_standby(node.ctx.launcher)
    assert node.ctx.warm is not None
    monkeypatch.setattr(node.ctx.warm, "ready", lambda: True)
    assert not node.warm_now()


def _quick_standby(tmp_path: Path) -> Starter:
    """A stand-in for trainer/standby.py without torch: says ready, waits for its line."""
    code = f"import os, sys; os.write(1, {READY_LINE!r}); sys.stdin.readline()"

    def start(env: dict[str, str], out_fd: int) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", code]
        return spawn(argv, env=env, cwd=tmp_path, log_fd=out_fd, stdin=subprocess.PIPE)

    return start


@only("postgres")
def test_the_heartbeat_thread_follows_the_standby(db_url: str, tmp_path: Path) -> None:
    """Ready: set within a poll; taken by a job, or dead: cleared within a poll."""
    url = db_url
    node = WorkerNode(_settings(url, tmp_path), "w1", CPU, "x")
    warm = node.ctx.warm
    assert warm is not None
    warm.starter = _quick_standby(tmp_path)
    node.register()
    warm.refill()
    try:
        _until(lambda: _ticked(node, url, True), "the warm mark")
        since = _warm_since(url, "w1")
        node.heartbeat_tick()  # still warm: kept, not renewed
        assert _warm_since(url, "w1") == since
        launch = Launch(spec_path=tmp_path / "spec.json", run_dir=tmp_path)
        handed = warm.hand_over(go_message(launch, warm._env, tmp_path / "log"), tmp_path / "log")
        assert handed is not None and handed.proc.wait(10) == 0  # it read its line: taken
        _until(lambda: _ticked(node, url, False), "the taken standby's mark to go", 10)
        warm.refill()
        _until(lambda: _ticked(node, url, True), "the next standby's mark")
        assert warm.proc is not None
        os.killpg(warm.proc.pid, signal.SIGKILL)  # died idle: not warm any more
        _until(lambda: _ticked(node, url, False), "the dead standby's mark to go", 10)
    finally:
        warm.close()


def _ticked(node: WorkerNode, db_url: str, warm: bool) -> bool:
    """One poll of the heartbeat thread, then whether the row says `warm`."""
    node.heartbeat_tick()
    return (_warm_since(db_url, node.worker_id) is not None) == warm


@only("postgres")
def test_the_mark_follows_the_standby_and_the_job_goes_to_the_warm_worker(
    db_url: str, tmp_path: Path
) -> None:
    url = db_url
    cold = WorkerNode(_settings(url, tmp_path / "w0", warm_trainer=False), "w0", CPU, "x")
    node = WorkerNode(_settings(url, tmp_path / "w1"), "w1", CPU, "x")
    warm = node.ctx.warm
    assert warm is not None
    cold.register()
    warm_for(node.ctx.launcher, node.ctx.settings, url)  # a zygote serves the job's user
    warm.refill()  # as run() does: on the main thread, then register, then the threads
    node.register()
    hb = threading.Thread(target=node._heartbeat_loop, daemon=True)
    hb.start()
    node.watchdog.start()  # keeps the trainer's lease fresh, as in a running worker
    try:
        _until(lambda: _warm_since(url, "w1") is not None, "w1's warm mark")
        cold.heartbeat_tick()  # both idle and live: w0 comes first in id order, but is cold
        with session_scope(url) as s:
            job_id = make_job(s, spec=QUICK).id
            (d,) = schedule(s, heartbeat_timeout_s=60)
        assert d.worker_id == "w1"
        assert warm.proc is not None
        standby = warm.proc.pid
        node._task(d.assignment_id)  # the job takes the standby; the next one starts
        with session_scope(url) as s:
            pid = s.get(Assignment, d.assignment_id).pid  # type: ignore[union-attr]
            assert s.get(Job, job_id).state == "succeeded"  # type: ignore[union-attr]
        zygote = getattr(node.ctx.launcher, "_zygote", None)
        if zygote is not None:  # the sandbox's zygote ran it in a fork and is back, warm
            assert zygote.proc.pid == standby and pid != standby
            assert warm.proc is zygote.proc
            assert _warm_since(url, "w1") is not None  # released warm: no import to wait for
        else:
            assert pid == standby
            assert _warm_since(url, "w1") is None  # released cold: the next one imports
        assert _warm_since(url, "w0") is None
    finally:
        node._hb_stop.set()
        hb.join(5)
        node.watchdog.stop()
        warm.close()
