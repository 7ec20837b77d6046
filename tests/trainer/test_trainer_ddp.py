"""DDP through the real torchrun (gloo on CPU), two processes on a free port: the same
weights as one process, and SIGTERM still ends with a checkpoint and a `stopped` event."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_testlib import (
    REPO,
    free_port,
    load_weights,
    make_spec,
    read_events,
    run_trainer,
    trainer_env,
    wait_for_event,
    write_spec,
)

pytestmark = pytest.mark.e2e

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun_cmd(spec: Path, run_dir: Path, nproc: int = 2) -> list[str]:
    return [*TORCHRUN, f"--nproc_per_node={nproc}", "--nnodes=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "torchyard.trainer",
            "--spec", str(spec), "--run-dir", str(run_dir)]  # fmt: skip


def test_two_processes_equal_one(tmp_path: Path) -> None:
    # No batch norm; 1438 training samples split evenly over 2 ranks.
    spec = write_spec(tmp_path / "spec.json", make_spec(world_size=2, epochs=2, batch_size=64))
    one, two = tmp_path / "one", tmp_path / "two"
    p = subprocess.run(torchrun_cmd(spec, two), cwd=REPO,
                       env=trainer_env(OMP_NUM_THREADS="1", TORCHYARD_ATTEMPT="2"),
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert p.returncode == 0, "\n".join(
        line for line in p.stderr.splitlines() if not line.startswith(("step ", "eval "))
    )[-8000:]
    q = run_trainer(spec, one, OMP_NUM_THREADS="1")
    assert q.returncode == 0, q.stderr

    a, b = load_weights(one), load_weights(two)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    ev1, ev2 = read_events(one), read_events(two)
    # rank 0 alone wrote: one `started`, saying two ranks
    started = [e for e in ev2 if e["type"] == "started"]
    assert len(started) == 1 and started[0]["world_size"] == 2 and ev1[0]["world_size"] == 1
    # every line says the attempt; the lifecycle ones rank 0's pid, as rank 0 logged it
    assert all(e["attempt"] == 2 for e in ev2)
    env = json.loads(next(s for s in p.stdout.splitlines() if s.startswith("environment: "))
                     .removeprefix("environment: "))  # fmt: skip
    assert env["rank"] == 0 and started[0]["pid"] == env["pid"]
    f1 = next(e for e in ev1 if e["type"] == "finished")
    f2 = next(e for e in ev2 if e["type"] == "finished")
    assert f1["step"] == f2["step"] == 46 and f2["pid"] == env["pid"]
    assert f1["metrics"]["val/accuracy"] == pytest.approx(f2["metrics"]["val/accuracy"], abs=0.01)
    assert f1["metrics"]["val/loss"] == pytest.approx(f2["metrics"]["val/loss"], rel=1e-3)


def test_sigterm_under_torchrun_stops_every_rank_at_one_checkpoint(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json",
                      make_spec(world_size=2, epochs=200, batch_size=32, log_every_steps=5))  # fmt: skip
    proc = subprocess.Popen(torchrun_cmd(spec, tmp_path), env=trainer_env(OMP_NUM_THREADS="1"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_event(
            tmp_path, lambda e: e["type"] == "metric" and e["step"] >= 10, proc, timeout=120
        )
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun reports any non-zero rank as its own failure: the outcome is in the events.
    assert proc.returncode != 0
    events = read_events(tmp_path)
    stopped = [e for e in events if e["type"] == "stopped"]
    assert len(stopped) == 1, [e["type"] for e in events[-5:]]
    ckpt = torch.load(tmp_path / stopped[0]["checkpoint"], weights_only=True)
    assert ckpt["step"] == stopped[0]["step"] and ckpt["world_size"] == 2
    assert len(ckpt["rng"]) == 2  # every rank's RNG state
