"""torchyard workers on a real Slurm cluster (tests/deploy/slurmlib.py: munged, slurmctld
and slurmd on this machine, CPUs only), started the way the README's "Workers on Slurm"
says: `torchyard slurm --device cpu`.

Two workers come up as one Slurm job array and take a world_size-2 job, one rank each.
Once the job has a checkpoint, one worker's Slurm job is `scancel`led: Slurm sends SIGTERM
to every process of that job (worker, bubblewrap, torchrun, trainer) and would SIGKILL
them after KillWait. The trainer must checkpoint, the attempt be handed back (not
counted: the spec allows no restart at all), the worker deregister and its Slurm job end
within KillWait. A worker submitted next through `torchyard slurm` takes the free rank and
the job resumes, ending with weights bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from slurmlib import KILL_WAIT_S, SlurmCluster, missing
from support.services import PrivatePostgres, PrivateRedis, missing_tools
from support.worker_cluster import (
    ROOT,
    Cluster,
    checkpointed_and_running,
    job_events,
    job_weights,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# digits, DDP over two ranks, ~420 steps: still training well after its first checkpoint.
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "batch_size": 64,
    "epochs": 30,
    "seed": 6,
    "world_size": 2,
    "precision": "fp32",
    "log_every_steps": 1,
    "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2},
    # A counted failure would fail the job: the Slurm stop must be a hand-back.
    "max_restarts": 0,
}
COUNTED = ("failed", "lost")


def _reference(out: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted run: torchrun with two local ranks, one thread each."""
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(SPEC))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHYARD_", "GLOO_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", "-m", "torchyard.trainer", "--spec",
                    str(out / "spec.json"), "--run-dir", str(out / "run")],
                   env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)  # fmt: skip
    return load_file(str(out / "run" / "model.safetensors"))


def _need() -> None:
    gone = missing() + missing_tools()
    if gone:
        msg = (
            f"the Slurm test needs {', '.join(sorted(set(gone)))} (apt-get install slurm-wlm munge)"
        )
        pytest.fail(msg, pytrace=False) if IN_CI else pytest.skip(msg)


@pytest.fixture
def slurm_pool(tmp_path: Path) -> Iterator[tuple[Cluster, SlurmCluster]]:
    """Private PostgreSQL, Redis, API and scheduler (no worker), and the Slurm cluster."""
    _need()
    pg, redis = PrivatePostgres(), PrivateRedis()
    slurm = SlurmCluster(tmp_path / "slurm")
    c: Cluster | None = None
    try:
        pg.start()
        redis.start()
        slurm.start()
        c = Cluster(tmp_path, database_url=pg.url(), broker_url=redis.url(),
                    extra_env={"TORCHYARD_TRAINER_THREADS": "1"})  # fmt: skip
        c.start(workers=0)
        yield c, slurm
    finally:
        slurm.stop()
        if c is not None:
            c.stop()
        redis.stop()
        pg.destroy()


def slurm_workers(c: Cluster, slurm: SlurmCluster, n: int) -> str:
    """`torchyard slurm --device cpu --workers n`, as the README runs it; the job id."""
    out = subprocess.run(
        [sys.executable, "-m", "torchyard", "slurm", "--device", "cpu", "--workers", str(n),
         "--log-dir", str(c.tmp / "slurm-logs"), "--parsable"],
        env=c.env | {"SLURM_CONF": str(slurm.conf)}, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _registered(c: Cluster, names: set[str]) -> bool:
    live = {w["id"]: w["state"] for w in c.get("/v1/workers")["items"]}
    return all(live.get(n) == "idle" for n in names)


def _attempts(c: Cluster, job_id: str) -> list[tuple[int, str, str | None]]:
    return [(a["number"], a["state"], a.get("reason")) for a in c.job(job_id)["attempts"]]


def test_workers_on_slurm_survive_scancel_and_resume_bitwise(
    slurm_pool: tuple[Cluster, SlurmCluster], tmp_path: Path
) -> None:
    c, slurm = slurm_pool
    t0 = time.monotonic()
    ref = ThreadPoolExecutor(max_workers=1).submit(_reference, tmp_path / "ref")
    first = slurm_workers(c, slurm, 2)
    w0, w1 = f"slurm-{first}-0", f"slurm-{first}-1"
    try:
        wait_for(lambda: _registered(c, {w0, w1}), 120, "both Slurm workers to register")
    except TimeoutError:
        raise AssertionError(f"{slurm.jobs()}\n{_logs(c)}\n{slurm.logs()}") from None
    job = c.submit(SPEC)["id"]
    a1 = wait_for(lambda: (j := c.job(job))["attempts"] and j["attempts"][0], 60, "an attempt")
    assert {w["worker_id"] for w in a1["workers"]} == {w0, w1}
    wait_for(lambda: checkpointed_and_running(c, job, 10), 120, "a checkpoint")

    # Slurm ends w1's job: SIGTERM to all of its processes, SIGKILL after KillWait.
    slurm.run("scancel", f"{first}_1")
    stopped = time.monotonic()
    wait_for(lambda: f"{first}_1" not in slurm.jobs(), KILL_WAIT_S + 10, "w1's Slurm job to end")
    assert time.monotonic() - stopped < KILL_WAIT_S, "the worker outlived KillWait: SIGKILLed"
    ended = wait_for(lambda: (a := c.job(job)["attempts"][0])["state"] != "running" and a,
                     30, "the first attempt's end")  # fmt: skip
    assert ended["state"] == "handed_back", _attempts(c, job)
    assert f"worker {w1} stopping" in (ended["reason"] or ""), ended["reason"]
    log = _logs(c)
    assert f"worker {w1} deregistered" in log, log[-3000:]
    # The trainer heard the SIGTERM and checkpointed where it stopped (not only at step 10).
    stops = [e for e in job_events(c, job) if e["type"] == "stopped" and e.get("attempt") == 1]
    assert stops and stops[-1]["checkpoint"], stops

    # The next worker Slurm starts takes the free rank; the job resumes from its checkpoint.
    second = slurm_workers(c, slurm, 1)
    final = c.wait_state(job, "succeeded", timeout=240)
    attempts = _attempts(c, job)
    assert not [a for a in attempts if a[1] in COUNTED], attempts
    last = final["attempts"][-1]
    assert {w["worker_id"] for w in last["workers"]} == {w0, f"slurm-{second}-0"}
    got, want = job_weights(c, job), ref.result(timeout=300)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"
    print(f"slurm test body: {time.monotonic() - t0:.1f}s; attempts {attempts}")


def _logs(c: Cluster) -> str:
    """Every Slurm worker's output (the worker's own log), one after the other."""
    d = c.tmp / "slurm-logs"
    return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')}" for f in sorted(d.glob("*")))
