"""Bring your own code, end to end with real processes (`torchyard api`, a scheduler, two
CPU workers), on the embedded defaults and on PostgreSQL + Redis: a bundle model on a
bundle data set, a torchvision model, an ImageFolder set of PNG files, script jobs at
world sizes 1 and 2, a worker SIGKILLed under a bundle-model job and under a script job,
a warm start, the permission to run code and a hostile archive over REST."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from proclib import tar_gz
from support.worker_cluster import (
    EMBEDDED,
    Cluster,
    backend_cluster,
    checkpointed_and_running,
    job_weights,
    pid_alive,
    running_worker,
    trainer_pid,
    wait_for,
)

from torchyard.client.sdk import Client

pytestmark = pytest.mark.e2e

MODELS = """
import math
from torch import nn

def build(in_shape, num_classes, width=64):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))
"""
DATA = '''
import torch

class Blobs(torch.utils.data.Dataset):
    """Deterministic: the same items in every process, so a resume is exact."""
    def __init__(self, n, dim, k, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(k, (n,), generator=g)
        centers = torch.randn(k, dim, generator=torch.Generator().manual_seed(99))
        self.x = centers[self.y] + 2 * torch.randn(n, dim, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

def build(root, n=512, dim=16, k=4):
    return Blobs(n, dim, k, 0), Blobs(n // 4, dim, k, 1), k
'''
# The script's own `trainer` and `client` modules: neither shadows torchyard's (which live
# under `torchyard.`) nor is shadowed by them.
USER_TRAINER = """
from torch import nn

def make_model(width):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 2))
"""
USER_CLIENT = 'METRIC = "user/step"\n'
SCRIPT = """
import argparse
import time

import torch
from torch import nn

import client
from torchyard import job
from trainer import make_model

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--save-every", type=int, default=10)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--declare-length", action="store_true")
a = p.parse_args()

ctx = job.setup(total_steps=a.steps if a.declare_length else None)
torch.manual_seed(0)
model = make_model(32).to(ctx.device)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
state = job.restore()
if state is not None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    start = state["step"]
    print(f"resumed at step {start}", flush=True)
net = torch.nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
g = torch.Generator().manual_seed(1)
X = torch.randn(512, 16, generator=g)
Y = (X[:, 0] > 0).long()
stopped = False
for step in range(start + 1, a.steps + 1):
    lo = (step * 32) % 512
    idx = torch.arange(lo, lo + 32)[ctx.rank :: ctx.world_size]
    loss = nn.functional.cross_entropy(net(X[idx]), Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    job.log(step, **{"train/loss": loss.item(), client.METRIC: step})
    if step % a.save_every == 0:
        job.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step)
    time.sleep(a.sleep)
    if job.should_stop():
        job.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step)
        stopped = True
        break
if not stopped:
    job.save_weights(model.state_dict())
"""

# A bundle model on a bundle data set, long enough (several seconds on one CPU thread) to
# be killed mid-run, with a resume checkpoint every 40 steps.
BUNDLE_LONG: dict[str, Any] = {
    "model": {"name": "mymodels:build", "args": {"width": 512}},
    "data": {"name": "mydata:build", "args": {"n": 6400, "dim": 784, "k": 10}, "num_workers": 0},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 2,
    "checkpoint": {"every_steps": 40, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 5,
    "seed": 11,
}
SCRIPT_SPEC: dict[str, Any] = {"entrypoint": {"script": "train.py", "args": []}}
# A script that keeps a plot (a PNG it draws with the standard library) and a config.
ARTIFACTS = r"""
import os, struct, tempfile, zlib
from torchyard import job

def png(w, h):
    raw = b"".join(b"\0" + bytes(v for x in range(w) for v in (x * 32 % 256, y * 32 % 256, 128))
                   for y in range(h))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    head = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))

job.setup()
job.log(1, loss=1.0)
job.save_artifact(png(8, 8), name="plot.png")
cfg = os.path.join(tempfile.mkdtemp(), "config.yaml")  # the bundle is read-only
open(cfg, "w").write("lr: 0.05\n")
job.save_artifact(cfg)
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bundle")
    (d / "mymodels.py").write_text(MODELS)
    (d / "mydata.py").write_text(DATA)
    (d / "trainer.py").write_text(USER_TRAINER)
    (d / "client").mkdir()
    (d / "client" / "__init__.py").write_text(USER_CLIENT)
    (d / "train.py").write_text(SCRIPT)
    (d / "artifacts.py").write_text(ARTIFACTS)
    return d


@pytest.fixture(scope="module", params=[EMBEDDED])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    yield from backend_cluster(request, tmp_path_factory, schedulers=1)


@pytest.fixture(scope="module")
def sdk(cluster: Cluster) -> Iterator[Client]:
    with Client(url=cluster.url, token=cluster.token) as client:
        yield client


@pytest.fixture(scope="module")
def bundle_ref(cluster: Cluster, sdk: Client, bundle: Path) -> dict[str, Any]:
    """BUNDLE_LONG run without interruption on this cluster: its job and final weights."""
    job = sdk.submit(BUNDLE_LONG, code=bundle)
    done = cluster.wait_state(job["id"], "succeeded", timeout=240)
    return {"job": done, "weights": job_weights(cluster, job["id"])}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _kill_running_worker(c: Cluster, job_id: str) -> str:
    victim, pid = running_worker(c, job_id), trainer_pid(c, job_id)
    c.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, "the orphaned trainer to die")
    return victim


def test_bundle_model_on_bundle_data_resumes_bitwise_after_a_sigkill(
    cluster: Cluster, sdk: Client, bundle: Path, bundle_ref: dict[str, Any]
) -> None:
    c = cluster
    ref = bundle_ref["job"]
    assert ref["spec"]["code"]["bundle"] and ref["progress"]["total_steps"] == 2 * 6400 // 32
    job = sdk.submit(BUNDLE_LONG, code=bundle)
    assert job["spec"]["code"] == ref["spec"]["code"]  # the same tree: the same bundle
    wait_for(lambda: checkpointed_and_running(c, job["id"], 80), 180, "a checkpoint at 80")
    victim = _kill_running_worker(c, job["id"])
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    assert [a["state"] for a in done["attempts"]] == ["lost", "succeeded"]
    _assert_bitwise(bundle_ref["weights"], job_weights(c, job["id"]))
    steps, _ = c.metrics(job["id"], "train/loss")
    assert steps == list(range(5, done["progress"]["total_steps"] + 1, 5))
    c.start_worker(victim)
    c.wait_workers(2)


def test_warm_start_from_another_job(
    cluster: Cluster, sdk: Client, bundle: Path, bundle_ref: dict[str, Any]
) -> None:
    """A job started from the reference job's weights, trained one step at a tiny lr, ends
    where that job ended (a fresh model would be nowhere near)."""
    spec = dict(BUNDLE_LONG, optimizer={"name": "sgd", "lr": 1e-9}, max_steps=1,
                init={"from_job": bundle_ref["job"]["id"], "checkpoint": "latest"})  # fmt: skip
    job = sdk.submit(spec, code=bundle)
    cluster.wait_state(job["id"], "succeeded", timeout=120)
    got = job_weights(cluster, job["id"])
    for k, v in bundle_ref["weights"].items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)


def test_torchvision_model_on_synthetic_images(cluster: Cluster, sdk: Client) -> None:
    spec = {
        "model": {"name": "torchvision/mobilenet_v3_small"},
        "data": {"name": "synthetic", "shape": [3, 32, 32], "size": 64, "num_classes": 4},
        "optimizer": {"name": "adam"},
        "batch_size": 8,
        "epochs": 1,
        "max_steps": 3,
    }
    job = sdk.submit(spec)
    cluster.wait_state(job["id"], "succeeded", timeout=120)
    assert job_weights(cluster, job["id"])["classifier.3.weight"].shape[0] == 4


def test_imagefolder_of_png_files(cluster: Cluster, sdk: Client) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    root = Path(cluster.settings().data) / "colours"
    for split in ("train", "val"):
        for c, colour in enumerate(((200, 30, 30), (30, 30, 200))):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(8):
                px = np.clip(rng.normal(colour, 25, (36, 44, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(px).save(d / f"{i}.png")
    spec = {
        "model": {"name": "lenet"},
        "data": {"name": "imagefolder/colours", "image_size": 24, "num_workers": 0},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "batch_size": 4,
        "epochs": 3,
    }
    job = sdk.submit(spec)
    done = cluster.wait_state(job["id"], "succeeded", timeout=120)
    assert done["latest_metrics"]["val/accuracy"]["value"] >= 0.5
    missing = dict(spec, data={"name": "imagefolder/nothere"})
    r = cluster.http.post("/v1/jobs", json=missing)
    assert r.status_code == 422 and r.json()["error"]["details"][0]["field"] == "data.name"


def test_script_jobs_at_world_size_1_and_2(cluster: Cluster, sdk: Client, bundle: Path) -> None:
    one = sdk.submit(dict(SCRIPT_SPEC, name="script-1"), code=bundle)
    two = sdk.submit(dict(SCRIPT_SPEC, name="script-2", world_size=2), code=bundle)
    for job in (one, two):
        done = cluster.wait_state(job["id"], "succeeded", timeout=180)
        steps, values = cluster.metrics(job["id"], "user/step")
        assert steps == list(range(1, 41)) and values == [float(s) for s in steps]
        _, losses = cluster.metrics(job["id"], "train/loss")
        assert losses[-1] < 0.8 * losses[0]
        assert done["latest_metrics"]["train/loss"]["value"] == pytest.approx(losses[-1])
        kinds = {ck["kind"] for ck in cluster.get(f"/v1/jobs/{job['id']}/checkpoints")["items"]}
        assert kinds == {"resume", "weights"}
        # No length declared: a finished script is as long as its last step (not `1/?`).
        assert (done["progress"]["step"], done["progress"]["total_steps"]) == (40, 40)
    assert [w["rank"] for w in cluster.job(two["id"])["attempts"][0]["workers"]] == [0, 1]
    r = cluster.http.get(f"/v1/jobs/{two['id']}/checkpoints/latest/download")
    assert r.status_code == 200


def test_a_script_jobs_artifacts_are_listed_and_download_with_their_sha256(
    cluster: Cluster, sdk: Client, bundle: Path, tmp_path: Path
) -> None:
    job = sdk.submit({"entrypoint": {"script": "artifacts.py"}}, code=bundle)
    cluster.wait_state(job["id"], "succeeded", timeout=120)
    listed = {a["name"]: a for a in sdk.artifacts(job["id"])}
    assert sorted(listed) == ["config.yaml", "plot.png"]
    dl = sdk.download_artifact(job["id"], "plot.png", tmp_path)
    assert dl.sha256 == listed["plot.png"]["sha256"] and dl.path.read_bytes()[:4] == b"\x89PNG"
    assert sdk.download_artifact(job["id"], "config.yaml", tmp_path).path.read_text() == (
        "lr: 0.05\n"
    )
    r = cluster.http.get(f"/v1/jobs/{job['id']}/artifacts/plot.png/download")
    assert r.headers["content-type"] == "image/png"


def test_script_job_resumes_after_a_sigkill(cluster: Cluster, sdk: Client, bundle: Path) -> None:
    c = cluster
    spec = dict(SCRIPT_SPEC, entrypoint={"script": "train.py",
                                         "args": ["--steps", "300", "--sleep", "0.03",
                                                  "--declare-length"]})  # fmt: skip
    job = sdk.submit(spec, code=bundle)
    wait_for(lambda: checkpointed_and_running(c, job["id"], 30), 120, "a checkpoint at 30")
    wait_for(lambda: (c.job(job["id"])["progress"] or {}).get("eta_s") is not None, 30,
             "an ETA")  # fmt: skip
    assert c.job(job["id"])["progress"]["total_steps"] == 300  # job.setup(total_steps=...)
    victim = _kill_running_worker(c, job["id"])
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    assert [a["state"] for a in done["attempts"]] == ["lost", "succeeded"]
    assert "resumed at step" in c.job_log(job["id"])
    steps, _ = c.metrics(job["id"], "user/step")
    assert steps == list(range(1, 301))  # unique and gap-free across the two attempts
    assert (done["progress"]["step"], done["progress"]["total_steps"]) == (300, 300)
    c.start_worker(victim)
    c.wait_workers(2)


def test_permission_and_a_hostile_archive_over_rest(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    from torchyard.store.auth import create_token

    with cluster.session() as s:
        plain = create_token(s, "no-code")
        granted = create_token(s, "coder", can_run_code=True)
    bid = sdk.submit(dict(SCRIPT_SPEC, name="ok"), code=bundle)["spec"]["code"]["bundle"]
    headers = {"Authorization": f"Bearer {plain}"}
    gz = {"Content-Type": "application/gzip"}
    r = cluster.http.post("/v1/bundles", content=tar_gz({"ok.py": b""}), headers=headers | gz)
    assert r.status_code == 403  # uploading code is the code permission's too
    r = cluster.http.post("/v1/bundles", content=tar_gz({"ok.py": b""}),
                          headers={"Authorization": f"Bearer {granted}"} | gz)  # fmt: skip
    assert r.status_code == 201
    spec = dict(SCRIPT_SPEC, code={"bundle": r.json()["id"]}, entrypoint={"script": "ok.py"})
    r = cluster.http.post("/v1/jobs", json=spec, headers=headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    # Bundles are owned: the admin's bundle is not this user's to name.
    r = cluster.http.post("/v1/jobs", json=dict(SCRIPT_SPEC, code={"bundle": bid}),
                          headers={"Authorization": f"Bearer {granted}"})  # fmt: skip
    assert r.status_code == 422
    r = cluster.http.post("/v1/bundles", content=tar_gz({"../evil.py": b"x"}),
                          headers={"Content-Type": "application/gzip"})  # fmt: skip
    assert r.status_code == 422 and "../evil.py" in r.text
    assert not (cluster.storage.parent / "evil.py").exists()
