"""Process-level contract: with TORCHYARD_DIE_WITH_PARENT=1 a trainer never outlives its
parent (the log's head is checked in test_trainer_resume.py, which runs the CLI anyway)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_testlib import REPO, make_spec, trainer_cmd, trainer_env, write_spec


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_trainer_dies_with_its_parent(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=100_000))
    run_dir = tmp_path / "run"
    # A parent that starts the trainer, says its pid, then waits (and gets SIGKILLed).
    parent_code = (
        "import subprocess, sys, json; "
        f"p = subprocess.Popen({json.dumps(trainer_cmd(spec, run_dir))}, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(p.pid, flush=True); p.wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, text=True,
                              stdout=subprocess.PIPE,
                              env=trainer_env(TORCHYARD_DIE_WITH_PARENT="1"))  # fmt: skip
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        events = run_dir / "events.jsonl"
        while not (events.exists() and events.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _alive(child), "the trainer should be running"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(child), "the trainer outlived its parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def test_a_repeated_sigterm_does_not_kill_before_the_checkpoint() -> None:
    """SIGTERM often arrives twice (worker → process group, and torchrun forwarding it): the
    second must not turn into an immediate exit that skips the checkpoint."""
    from torchyard.trainer.cli import _install_stop_handlers
    from torchyard.trainer.signals import StopFlag

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopFlag()
    try:
        _install_stop_handlers(stop)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0)  # handlers run between bytecodes
        assert stop.signal == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # a later Ctrl-C neither replaces nor kills
        assert stop.signal == "SIGTERM"
    finally:
        for s, h in before.items():
            signal.signal(s, h)
