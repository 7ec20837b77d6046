"""docker-compose.yml started for real: every image built here, the stack run by
podman-compose on podman with deploy/compose.cpu.yml (two CPU workers, host networking,
tests/deploy/podmanlib.py says why and how).

A world_size-2 job (one rank in each worker container) is submitted through the API's port
with the `torchyard` client, followed to its end and its checkpoint downloaded. Then each
of api, scheduler, a worker, PostgreSQL, Redis and the object store is restarted in turn
while a job runs, and that job must still succeed. Last, everything is stopped and the
containers, volumes and images the test made are removed (the cached base image stays).

Slow (image builds: minutes) and needs root and podman: it runs only when asked for,
`bash scripts/deploy_test.sh` (which sets TORCHYARD_DEPLOY_TEST=1) or `-m deploy`; asked
for, a missing tool is a failure, never a skip. TORCHYARD_DEPLOY_KEEP_IMAGES=1 keeps the
built images for the next run (and reuses those already there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from podmanlib import PROJECT, Stack, build_images, podman_env, remove_images, stack_env

# The first test's setup builds every image: many minutes on a small host.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600)]

# DDP over two worker containers: 1000 steps (half a minute here, long enough to outlast
# a restart), a resume checkpoint every 20.
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [256]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 8000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 4,
    "world_size": 2,
    "checkpoint": {"every_steps": 20, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 10,
    "seed": 3,
}
RESTARTED = ["api", "scheduler", "worker-cpu0", "postgres", "redis", "objectstore"]
HEALTH_CHECKED = {"api", "postgres", "redis", "objectstore"}
ENDED = ("succeeded", "failed", "cancelled")
TIMINGS: dict[str, Any] = {}


def _asked(config: pytest.Config) -> bool:
    if os.environ.get("TORCHYARD_DEPLOY_TEST") == "1":
        return True
    expr = str(config.getoption("markexpr") or "")
    return "deploy" in expr and "not deploy" not in expr


def _start(s: Stack) -> None:
    """In depends_on order, each step's health checks or exit status awaited."""
    s.up("postgres", "redis", "objectstore")
    for name in ("postgres", "redis", "objectstore"):
        s.wait_healthy(name)
    s.up("bucket", "migrate")
    s.wait_completed("bucket")
    s.wait_completed("migrate")
    # Done with: vfs keeps a whole copy of the (6 GB) image for each container.
    s.podman("rm", s.container("bucket"), s.container("migrate"))
    s.up("api", "scheduler", "worker-cpu0", "worker-cpu1")
    s.wait_healthy("api")


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if not _asked(request.config):
        pytest.skip("runs only when asked for: bash scripts/deploy_test.sh (or -m deploy)")
    env = podman_env()
    keep = os.environ.get("TORCHYARD_DEPLOY_KEEP_IMAGES") == "1"
    t0 = time.monotonic()
    s = Stack(stack_env(env))
    try:
        TIMINGS["build_s"] = build_images(env, keep)
        t1 = time.monotonic()
        _start(s)
        TIMINGS["up_s"] = round(time.monotonic() - t1, 1)
        out = s.podman("exec", s.container("api"), "torchyard", "token", "create",
                       "--local", "--user", "admin", "--admin")  # fmt: skip
        s.env["TORCHYARD_TOKEN"] = out.strip().splitlines()[-1]
        s.env["TORCHYARD_URL"] = s.api_url
        yield s
    finally:
        t2 = time.monotonic()
        try:
            s.down()
        finally:
            if not keep:
                remove_images(env)
        TIMINGS["down_s"] = round(time.monotonic() - t2, 1)
        TIMINGS["total_s"] = round(time.monotonic() - t0, 1)
        folder = Path(os.environ.get("TORCHYARD_DEPLOY_DIR", "/var/tmp/torchyard-deploy"))
        (folder / "timings.json").write_text(json.dumps(TIMINGS))
    _assert_nothing_left(env, keep)


def _assert_nothing_left(env: dict[str, str], keep: bool) -> None:
    label = f"label=io.podman.compose.project={PROJECT}"
    for what, which in ((["ps", "-a", "-q"], label), (["volume", "ls", "-q"], label),
                        (["pod", "ls", "-q"], f"name=pod_{PROJECT}")):  # fmt: skip
        out = subprocess.run(["podman", *what, "--filter", which], env=env,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert not out.split(), f"left after the test: podman {what[0]}: {out}"
    if not keep:
        out = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"],
                             env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert not [i for i in out.split() if i.endswith(":deploy-test")], out


def _client(s: Stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The `torchyard` client on this host, talking to the stack's API port."""
    argv = [str(Path(sys.executable).parent / "torchyard"), *args]
    return subprocess.run(argv, env=s.env, capture_output=True, text=True, timeout=timeout)


def _submit(s: Stack, tmp: Path, **overrides: Any) -> str:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(SPEC | overrides))
    p = _client(s, "submit", str(spec))
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def _job(s: Stack, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{s.api_url}/v1/jobs/{job_id}", timeout=10,
                  headers={"Authorization": f"Bearer {s.env['TORCHYARD_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    return r.json()


def _checkpoints(s: Stack, job_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{s.api_url}/v1/jobs/{job_id}/checkpoints", timeout=10,
                  headers={"Authorization": f"Bearer {s.env['TORCHYARD_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    return r.json()["items"]


def _wait_checkpointed(s: Stack, job_id: str, timeout: float = 300) -> None:
    """Until the job runs and has a checkpoint: a restart now interrupts real work."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = _job(s, job_id)
        assert j["state"] not in ENDED, f"job {j['state']}: {j.get('error')}"
        if j["state"] == "running" and _checkpoints(s, job_id):
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} never checkpointed while running\n{s.all_logs()}")


def _follow_to_success(s: Stack, job_id: str) -> dict[str, Any]:
    """`torchyard status --follow` until the job ends; it must have succeeded."""
    p = _client(s, "status", "--follow", "--interval", "2", job_id)
    j = _job(s, job_id)
    assert j["state"] == "succeeded", (
        f"{j['state']}: {j.get('error')}\n{p.stdout[-2000:]}\n{s.all_logs()}"
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return j


def test_a_ddp_job_runs_and_its_checkpoint_downloads(stack: Stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    job_id = _submit(stack, tmp_path)
    j = _follow_to_success(stack, job_id)
    TIMINGS["first_job_s"] = round(time.monotonic() - t0, 1)
    ranks = {w["rank"] for a in j["attempts"] for w in a["workers"]}
    workers = {w["worker_id"] for a in j["attempts"] for w in a["workers"]}
    assert ranks == {0, 1} and len(workers) == 2, j["attempts"]
    out = tmp_path / "ckpt"
    p = _client(stack, "download", job_id, "-c", "weights", "-o", str(out))
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file

    weights = load_file(str(out))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    p = _client(stack, "download", job_id, "-o", str(tmp_path / "resume"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "resume").stat().st_size > 0


@pytest.mark.parametrize("service", RESTARTED)
def test_a_job_survives_a_restart_of(stack: Stack, tmp_path: Path, service: str) -> None:
    t0 = time.monotonic()
    job_id = _submit(stack, tmp_path, seed=len(service))
    _wait_checkpointed(stack, job_id)
    # A worker checkpoints its trainer on SIGTERM and hands the job back: give it time.
    stack.compose("restart", "-t", "60", service)
    if service in HEALTH_CHECKED:
        stack.wait_healthy(service)
    stack.wait_healthy("api")  # its readiness: the database and the broker answer
    state = _job(stack, job_id)["state"]
    assert state not in ENDED, f"the job was {state} before the restart was over: lengthen SPEC"
    j = _follow_to_success(stack, job_id)
    if service.startswith("worker"):
        # The stopped worker checkpointed its rank and handed the job back: a new attempt.
        assert len(j["attempts"]) >= 2, j["attempts"]
    TIMINGS[f"restart_{service}_s"] = round(time.monotonic() - t0, 1)
