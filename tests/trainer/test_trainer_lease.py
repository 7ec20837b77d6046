"""The worker's lease on its trainer (trainer/lease.py): a trainer whose worker stops
vouching for it (frozen, cut off from the store) checkpoints and stops by itself, and
exits outright if that takes too long."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from trainer_testlib import REPO, make_spec, trainer_cmd, trainer_env, write_spec

from torchyard.contracts import exitcodes
from torchyard.trainer.lease import LEASE_SIGNAL, LeaseError, watch_lease
from torchyard.trainer.signals import StopFlag


def test_lease_variables_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHYARD_LEASE_FILE", raising=False)
    assert watch_lease(StopFlag()) is None  # run by hand: no lease
    monkeypatch.setenv("TORCHYARD_LEASE_FILE", str(tmp_path / "lease"))
    monkeypatch.setenv("TORCHYARD_LEASE_STOP_S", "soon")
    monkeypatch.setenv("TORCHYARD_LEASE_KILL_S", "5")
    with pytest.raises(LeaseError, match="TORCHYARD_LEASE_STOP_S"):
        watch_lease(StopFlag())
    monkeypatch.setenv("TORCHYARD_LEASE_STOP_S", "6")
    with pytest.raises(LeaseError, match="TORCHYARD_LEASE_KILL_S"):
        watch_lease(StopFlag())


def test_a_stale_lease_sets_the_stop_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lease = tmp_path / "lease"
    lease.touch()
    monkeypatch.setenv("TORCHYARD_LEASE_FILE", str(lease))
    monkeypatch.setenv("TORCHYARD_LEASE_STOP_S", "0.3")
    monkeypatch.setenv("TORCHYARD_LEASE_KILL_S", "1000")
    stop, done = StopFlag(), threading.Event()
    # In this process the watcher must end with the test: left running, the lease it
    # watches goes stale and, KILL_S later, it ends pytest itself with exit code 75.
    watcher = watch_lease(stop, done)
    assert watcher is not None
    try:
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:  # kept fresh: no stop
            os.utime(lease)
            time.sleep(0.02)
        assert stop.signal is None
        time.sleep(0.6)
        assert stop.signal == LEASE_SIGNAL
    finally:
        done.set()
        watcher.join(5)
    assert not watcher.is_alive()


@pytest.mark.e2e
def test_trainer_checkpoints_and_stops_when_nobody_vouches(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=100_000))
    run_dir = tmp_path / "run"
    lease = tmp_path / "lease"
    lease.touch()
    env = trainer_env(
        TORCHYARD_LEASE_FILE=str(lease), TORCHYARD_LEASE_STOP_S="1", TORCHYARD_LEASE_KILL_S="60"
    )
    proc = subprocess.Popen(trainer_cmd(spec, run_dir), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    events = run_dir / "events.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b'"metric"' not in (
            events.read_bytes() if events.exists() else b""
        ):
            os.utime(lease)  # the worker vouches while the trainer gets going
            time.sleep(0.05)
        rc = proc.wait(timeout=60)  # then it stops refreshing
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == exitcodes.PREEMPTED, proc.stderr.read() if proc.stderr else ""
    evs = [json.loads(line) for line in events.read_text().splitlines()]
    stopped = [e for e in evs if e["type"] == "stopped"]
    assert stopped and stopped[0]["signal"] == LEASE_SIGNAL
    assert (run_dir / stopped[0]["checkpoint"]).is_file()


@pytest.mark.e2e
def test_trainer_exits_outright_when_the_stop_takes_too_long(tmp_path: Path) -> None:
    """A trainer that cannot reach a step boundary (here: still loading) exits at the kill
    limit all the same."""
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=100_000))
    lease = tmp_path / "lease"
    lease.touch()
    os.utime(lease, (0, 0))  # stale from the start
    env = trainer_env(
        TORCHYARD_LEASE_FILE=str(lease), TORCHYARD_LEASE_STOP_S="0.1", TORCHYARD_LEASE_KILL_S="0.2"
    )
    t0 = time.monotonic()
    rc = subprocess.run(trainer_cmd(spec, tmp_path / "run"), cwd=REPO, env=env,
                        capture_output=True, timeout=60).returncode  # fmt: skip
    assert rc == exitcodes.PREEMPTED and time.monotonic() - t0 < 30


@pytest.mark.e2e
def test_a_full_disk_is_reported_as_storage_full(tmp_path: Path, full_disk: Path) -> None:
    """Not the job's fault: exit 5 (STORAGE_FULL), which the worker hands back instead of
    counting against max_restarts."""
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=1))
    proc = subprocess.run(trainer_cmd(spec, full_disk), cwd=REPO, env=trainer_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == exitcodes.STORAGE_FULL, proc.stderr[-2000:]
    assert "storage_full" in proc.stderr
