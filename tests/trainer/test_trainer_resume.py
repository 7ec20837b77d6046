"""Kill and resume with the real `python -m torchyard.trainer` process: SIGKILL mid-epoch, then resume
from the latest checkpoint, ends with weights bitwise equal to an uninterrupted run (CPU,
fp32); SIGTERM saves a loadable checkpoint, writes `stopped` and exits 75."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from trainer_testlib import (
    REPO,
    load_weights,
    make_spec,
    read_events,
    run_trainer,
    trainer_cmd,
    trainer_env,
    wait_for_event,
    write_spec,
)

from torchyard.contracts import exitcodes
from torchyard.trainer.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.e2e

# 360 steps of a 300k-parameter MLP: long enough (about a second) to be killed mid-run.
SPEC = make_spec(model={"name": "mlp", "hidden": [512, 512]}, batch_size=32, epochs=8,
                 log_every_steps=5, checkpoint={"every_epochs": None, "every_steps": 50, "keep_last": 2})  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1"}  # the same thread count in every run (and no oversubscription)


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("spec") / "spec.json", SPEC)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, spec_path: Path) -> dict:
    run_dir = tmp_path_factory.mktemp("reference")
    p = run_trainer(spec_path, run_dir, **ENV)
    assert p.returncode == 0, p.stderr
    # the log (kept by the worker) opens with the environment and the spec
    lines = p.stdout.splitlines()
    assert lines[0].startswith("environment: ") and lines[1].startswith("spec: ")
    env = json.loads(lines[0].removeprefix("environment: "))
    assert env["device"] == "cpu" and env["world_size"] == 1 and env["threads"] == 1
    assert json.loads(lines[1].removeprefix("spec: "))["model"] == SPEC["model"]
    assert "finished at step 360" in lines[-1]
    return load_weights(run_dir)


def _start(spec_path: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(trainer_cmd(spec_path, run_dir), env=trainer_env(**ENV), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(tmp_path: Path, spec_path: Path,
                                                        reference: dict) -> None:  # fmt: skip
    proc = _start(spec_path, tmp_path)
    try:
        wait_for_event(tmp_path, lambda e: e["type"] == "checkpoint" and e["step"] >= 100, proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not [e for e in read_events(tmp_path) if e["type"] == "finished"], "killed too late"
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    ckpt = load_checkpoint(latest)
    assert 0 < ckpt["batch_in_epoch"] < 45, "the kill should land mid-epoch"

    p = run_trainer(spec_path, tmp_path, "--resume", str(latest), **ENV)
    assert p.returncode == 0, p.stderr
    _assert_bitwise_equal(load_weights(tmp_path), reference)
    started = [e for e in read_events(tmp_path) if e["type"] == "started"]
    assert len(started) == 2 and started[1]["step"] == ckpt["step"]
    assert started[1]["resumed_from"] == f"checkpoints/{latest.name}"


def test_sigterm_saves_a_checkpoint_and_exits_75(tmp_path: Path, spec_path: Path,
                                                 reference: dict) -> None:  # fmt: skip
    proc = _start(spec_path, tmp_path)
    try:
        wait_for_event(tmp_path, lambda e: e["type"] == "metric" and e["step"] >= 20, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exitcodes.PREEMPTED, proc.stderr.read() if proc.stderr else ""
    events = read_events(tmp_path)
    stopped = events[-1]
    assert stopped["type"] == "stopped" and stopped["signal"] == "SIGTERM"
    assert stopped["pid"] == proc.pid and isinstance(stopped["time"], float)
    announced = events[-2]
    assert announced["type"] == "checkpoint" and announced["path"] == stopped["checkpoint"]
    ckpt = torch.load(tmp_path / stopped["checkpoint"], weights_only=True)
    assert ckpt["step"] == stopped["step"] and ckpt["step"] < 360

    # the preempted run resumes (as a worker would: `--resume latest`) to the same weights
    p = run_trainer(spec_path, tmp_path, "--resume", "latest", **ENV)
    assert p.returncode == 0, p.stderr
    _assert_bitwise_equal(load_weights(tmp_path), reference)
