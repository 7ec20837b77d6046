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
from proclib import assert_dies_with_parent
from trainer_testlib import REPO, make_spec, trainer_cmd, trainer_env, write_spec


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
    deadline = time.monotonic() + 60
    events = run_dir / "events.jsonl"
    while not (events.exists() and events.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_dies_with_parent(parent, child, "trainer")


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_die_with_parent_sets_the_parent_death_signal() -> None:
    # In a child process: the setting would outlive the test in this one.
    code = (
        "import ctypes, signal; from torchyard.contracts.parent import die_with_parent; "
        "libc = ctypes.CDLL(None); before = ctypes.c_int(-1); after = ctypes.c_int(-1); "
        "libc.prctl(2, ctypes.byref(before), 0, 0, 0); "  # PR_GET_PDEATHSIG
        "ok = die_with_parent(signal.SIGUSR1); "
        "libc.prctl(2, ctypes.byref(after), 0, 0, 0); "
        "print(before.value, ok, after.value == signal.SIGUSR1)"
    )
    p = subprocess.run([sys.executable, "-c", code], env=trainer_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "True", "True"]
