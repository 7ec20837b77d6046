"""The main job on a real GPU, end to end (the `gpu` group: runs only where CUDA is).

`torchyard api`, `torchyard scheduler` and one worker started with the command of
docker-compose.yml's `worker-gpu0` service (`worker --gpu 0 --name …`: in a container the
NVIDIA runtime exposes the one GPU the service reserved, always as index 0; on a one-GPU
host, as here, index 0 is that GPU too), on the embedded defaults (SQLite, the filesystem
broker). A bf16 AMP job goes in over REST and must run on that GPU, pinned by its UUID
(the trainer's environment line), with its system metrics read through NVML, its
checkpoints recorded and its final weights downloadable through the API and loadable with
`weights_only=True`."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load as load_safetensors
from support.worker_cluster import ROOT, Cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPEC: dict[str, Any] = {
    "name": "gpu-e2e",
    "model": {"name": "mlp", "hidden": [256, 256]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 4096, "num_classes": 10},
    "optimizer": {"name": "adamw", "lr": 0.001},
    "precision": "bf16",
    "batch_size": 64,
    "epochs": 3,
    "checkpoint": {"every_steps": 40, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 8,
    "seed": 1,
}


def compose_worker_command() -> list[str]:
    """docker-compose.yml's `worker-gpu0` command, its `${VAR:-default}`s at their defaults."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["worker-gpu0"]["command"]
    assert command[:3] == ["worker", "--gpu", "0"], command
    return [a.replace("${TORCHYARD_HOST_ID:-gpuhost1}", "gpuhost1") for a in command]


def gpu_uuid() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.strip()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_env={"TORCHYARD_SYS_METRICS_INTERVAL_S": "1"})
    try:
        c.start(workers=0)
        c._spawn("worker-gpu0", compose_worker_command())
        yield c
    finally:
        c.stop()


def test_a_bf16_job_runs_on_the_pinned_gpu_and_its_weights_download(cluster: Cluster) -> None:
    (worker,) = cluster.wait_workers(1, timeout=120)
    assert worker["id"] == "gpuhost1-gpu0" and worker["gpu"] == 0
    # Confined as on any host (worker/sandbox.py binds the GPU's device nodes in), not run
    # unsandboxed because bubblewrap was missing.
    assert "trainers run sandboxed" in cluster.log_of("worker-gpu0"), cluster.log_of("worker-gpu0")
    assert worker["device"].startswith("cuda") and worker["device_name"]
    job = cluster.submit(SPEC)
    done = cluster.wait_state(job["id"], "succeeded", timeout=300)

    log = cluster.job_log(job["id"])
    line = next(ln for ln in log.splitlines() if "environment: " in ln)
    env = json.loads(line.split("environment: ", 1)[1])
    assert env["device"] == "cuda:0" and env["cuda_visible_devices"] == gpu_uuid(), env
    assert done["attempts"][-1]["workers"][0]["worker_id"] == "gpuhost1-gpu0"

    _, loss = cluster.metrics(job["id"], "train/loss")
    assert len(loss) >= 5 and all(torch.isfinite(torch.tensor(loss)))
    assert loss[-1] < loss[0]
    steps, memory = cluster.metrics(job["id"], "sys/gpu_memory_bytes")
    assert steps and max(memory) > 0  # NVML, read for the worker's pinned GPU
    checkpoints = cluster.get(f"/v1/jobs/{job['id']}/checkpoints")["items"]
    assert checkpoints and all(ck["sha256"] for ck in checkpoints)

    base = f"/v1/jobs/{job['id']}/checkpoints/latest/download"
    r = cluster.http.get(base, params={"kind": "weights"})
    assert r.status_code == 200, r.text
    assert r.headers["ETag"].strip('"') == hashlib.sha256(r.content).hexdigest()
    weights = load_safetensors(r.content)
    assert weights and all(torch.isfinite(t.float()).all() for t in weights.values())
    latest = cluster.http.get(base)
    assert latest.status_code == 200, latest.text
    state = torch.load(io.BytesIO(latest.content), map_location="cpu", weights_only=True)
    assert isinstance(state, dict) and state
