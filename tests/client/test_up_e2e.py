"""The CLI against a real `torchyard up` (API, scheduler, 2 CPU workers, trainers: all real
processes) in a temporary TORCHYARD_HOME. One `up` serves the whole module; the last test
restarts it in the middle of a job."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from up_server import JOB_S, Up

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    server = Up.in_temp(tmp_path_factory.mktemp("tyup"))
    server.start()
    yield server
    rc = server.stop()
    assert rc == 0, server.log.read_text()


@pytest.fixture(scope="module")
def digits_job(up: Up) -> str:
    r = up.cli("submit", "examples/digits.json", "--follow")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_up_wrote_a_private_admin_token(up: Up) -> None:
    token_file = up.home / "admin-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.read_text().startswith("ty_")
    assert token_file.read_text().strip() in up.log.read_text()  # printed for the user


def test_submit_follow_runs_digits_to_success(up: Up, digits_job: str) -> None:
    assert len(digits_job) == 32  # stdout holds the id alone
    r = up.cli("status", digits_job, "--json")
    job = json.loads(r.stdout)
    assert job["state"] == "succeeded"
    assert job["progress"]["step"] == job["progress"]["total_steps"] > 0
    r = up.cli("workers")
    assert r.returncode == 0 and r.stdout.count("-cpu") == 2


def test_metrics_csv(up: Up, digits_job: str) -> None:
    r = up.cli("metrics", digits_job, "--csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    steps = [int(row["step"]) for row in rows]
    assert steps == sorted(set(steps)) and steps[0] > 0
    losses = [float(row["train/loss"]) for row in rows if row["train/loss"]]
    acc = [float(row["val/accuracy"]) for row in rows if row["val/accuracy"]]
    assert len(losses) > 10 and losses[-1] < losses[0] / 3  # it learned
    assert acc[-1] > 0.85  # the bundled digits with an MLP: ~0.97


def test_download_verifies_sha256_and_loads(up: Up, digits_job: str, tmp_path: Path) -> None:
    r = up.cli("download", digits_job, "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.iterdir()
    with up.client() as ty:
        weights = [c for c in ty.checkpoints(digits_job) if c["kind"] == "weights"]
    assert path.suffix == ".safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == weights[0]["sha256"]
    assert f"sha256 {weights[0]['sha256']} verified" in r.stdout and "load_file(" in r.stdout
    assert "torchyard.load_model(" in r.stdout
    from safetensors.numpy import load_file  # no torch needed to check the tensors

    tensors = load_file(str(path))
    assert tensors and all(t.size > 0 for t in tensors.values())


def test_interrupted_download_resumes_from_its_part_file(
    up: Up, digits_job: str, tmp_path: Path
) -> None:
    with up.client() as ty:
        ckpt = next(c for c in reversed(ty.checkpoints(digits_job)) if c["kind"] == "resume")
        whole = ty.download(digits_job, ckpt["id"], tmp_path / "whole.pt").path.read_bytes()
    out = tmp_path / "resumed.pt"
    # What a download cut off half-way leaves behind.
    Path(f"{out}.part").write_bytes(whole[: len(whole) // 2])
    r = up.cli("download", digits_job, "--checkpoint", str(ckpt["id"]), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == whole and not Path(f"{out}.part").exists()
    assert "resumed after" in r.stdout and f"sha256 {ckpt['sha256']} verified" in r.stdout
    assert "weights_only=True" in r.stdout


def test_bad_spec_is_one_line_and_exit_2(up: Up, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {name: mlp}\ndata: {name: digits}\noptimizer: {name: sgd, lr: 0}\n"
        "batch_size: many\n"
    )
    r = up.cli("submit", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: 422 ")
    assert "optimizer.lr: must be > 0" in lines[0] and "batch_size: must be an integer" in lines[0]


def test_a_killed_worker_is_reported_and_replaced(up: Up, digits_job: str) -> None:
    with up.client() as ty:
        victim = next(w for w in ty.workers() if w["state"] == "idle")
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            same = [w for w in ty.workers() if w["id"] == victim["id"]]
            if same and same[0]["pid"] != victim["pid"] and same[0]["state"] == "idle":
                break
            assert time.monotonic() < deadline, up.log.read_text()
            time.sleep(0.3)
    assert "exited with code -9" in up.log.read_text()


# Enough steps (~10 s of training) to be caught in the middle even with fast trainers, small
# enough for a 2-core machine.
LONG_SPEC = {
    "name": "restart-me",
    "model": {"name": "mlp", "hidden": [1024, 1024]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "num_classes": 10, "size": 16384},
    "optimizer": {"name": "sgd", "lr": 0.01},
    "batch_size": 64,
    "epochs": 8,
    "precision": "fp32",
    "log_every_steps": 10,
    "checkpoint": {"every_epochs": None, "every_steps": 50, "keep_last": 50},
}


def test_up_restarted_mid_job_resumes_it_with_history_intact(
    up: Up, digits_job: str, tmp_path: Path
) -> None:
    spec = tmp_path / "long.json"
    spec.write_text(json.dumps(LONG_SPEC))
    job_id = up.cli("submit", str(spec)).stdout.strip()
    with up.client() as ty:
        deadline = time.monotonic() + JOB_S
        while ((ty.job(job_id).get("progress") or {}).get("step") or 0) < 60:
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.2)
        before = ty.metrics(job_id, name="train/loss")["train/loss"]

    assert up.stop() == 0, up.log.read_text()
    assert "stopped" in up.log.read_text()
    up.start()  # same TORCHYARD_HOME: picks up where it stopped

    r = up.cli("status", job_id, "--follow")
    assert r.returncode == 0, r.stderr + up.log.read_text()
    with up.client() as ty:
        job = ty.job(job_id)
        attempts = job["attempts"]
        # The first attempt was handed back by its stopping worker (trainer exit 75), a later
        # one finished the job.
        assert attempts[0]["state"] == "handed_back" and attempts[0]["exit_code"] == 75
        assert attempts[-1]["state"] == "succeeded"
        assert job["state"] == "succeeded"
        # One loss per logged step from first to last, the pre-restart points unchanged.
        loss = ty.metrics(job_id, name="train/loss")["train/loss"]
        total = job["progress"]["total_steps"]
        steps = loss["steps"]
        assert steps == sorted(set(steps)) and steps[-1] == total
        assert [s for s in steps if s % 10 == 0] == list(range(10, total + 1, 10))
        old = dict(zip(before["steps"], before["values"], strict=True))
        new = dict(zip(loss["steps"], loss["values"], strict=True))
        assert old and all(new[s] == v for s, v in old.items())
        # Checkpoints of the first attempt are still on record, next to the final weights.
        ckpts = ty.checkpoints(job_id)
        assert any(c["attempt"] == attempts[0]["number"] for c in ckpts)
        assert any(c["kind"] == "weights" for c in ckpts)
        # Nothing from before the restart was lost.
        assert ty.job(digits_job)["state"] == "succeeded"
    log = up.cli("logs", job_id).stdout
    assert "resuming from checkpoints/" in log  # the resumed attempt started from the checkpoint
