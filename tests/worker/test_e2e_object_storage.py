"""End to end with nothing shared but PostgreSQL, Redis and an S3 object store (real
SeaweedFS): the API and each worker "host" have their own TORCHYARD_HOME and storage
root (a cache), so every checkpoint, log line and download crosses the object store.

A job trains on host A; its log is read and followed through the API, its checkpoints are
objects whose sha256 the store recorded, and its weights download through the API. Host A
is SIGKILLed mid-run: the job resumes on host B from the checkpoint A uploaded and ends
with weights bitwise equal to an uninterrupted run."""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load
from support.worker_cluster import (
    Cluster,
    checkpointed_and_running,
    pid_alive,
    running_worker,
    s3_cluster,
    trainer_pid,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.redis]

# A few seconds of training (1000 steps: long enough to be killed well before its end), a
# resume checkpoint every 30 steps.
LONG: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [512, 512]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 8000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    # A trainer exits within ~50 ms of its last step: the run must go on well after its
    # checkpoint at step 60 is recorded (uploaded first) for the host-kill test.
    "epochs": 5,
    "checkpoint": {"every_steps": 30, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 5,
    "seed": 7,
}


class Hosts:
    """The cluster and how each "host" is started: its own home and cache."""

    def __init__(self, c: Cluster, tmp: Path, store: Any) -> None:
        self.c, self.tmp, self.store = c, tmp, store

    def start(self, name: str, host: str | None = None) -> None:
        """Worker `name` on host `host` (default: a host of its own); workers of one host
        share its cache, each with its own home."""
        root = self.tmp / f"host-{host or name}"
        env = {
            "TORCHYARD_HOME": str(root / f"home-{name}"),
            "TORCHYARD_STORAGE_ROOT": str(root / "cache"),
        }
        self.c.start_worker(name, env)

    def cache(self, name: str) -> Path:
        return self.tmp / f"host-{name}" / "cache"


@pytest.fixture(scope="module")
def hosts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, s3_server: Any
) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("s3-cluster")
    with s3_cluster(request, tmp, s3_server) as (c, env):
        h = Hosts(c, tmp, None)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            from torchyard.storage import storage_for

            h.store = storage_for(c.settings())
            yield h


def _log(c: Cluster, job_id: str) -> str:
    """The whole log as the API serves it, followed chunk by chunk to its end."""
    out, offset = [], 0
    while True:
        r = c.http.get(f"/v1/jobs/{job_id}/logs", params={"offset": offset, "limit": 4096})
        assert r.status_code == 200, r.text
        chunk = r.json()
        out.append(chunk["data"])
        if chunk["next_offset"] >= chunk["size"]:
            assert chunk["complete"]
            return "".join(out)
        offset = chunk["next_offset"]


def _weights(h: Hosts, job_id: str) -> dict[str, torch.Tensor]:
    listed = h.c.get(f"/v1/jobs/{job_id}/checkpoints")["items"]
    row = next(ck for ck in listed if ck["kind"] == "weights")
    with h.store.open_read(h.store.checkpoint_key(job_id, row["path"], row["sha256"])) as f:
        return load(f.read())


@pytest.fixture(scope="module")
def reference(hosts: Hosts) -> dict[str, torch.Tensor]:
    """LONG without interruption, on host A."""
    hosts.start("a")
    hosts.c.wait_workers(1)
    job = hosts.c.submit(LONG)
    hosts.c.wait_state(job["id"], "succeeded", timeout=180)
    return _weights(hosts, job["id"])


def test_a_job_runs_logs_and_downloads_through_the_object_store(
    hosts: Hosts, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from torchyard.client.sdk import Client

    c = hosts.c
    job = c.submit(LONG)
    done = c.wait_state(job["id"], "succeeded", timeout=180)
    jid = done["id"]
    # The log, as the API serves it, is whole: from the attempt's banner to its end.
    text = _log(c, jid)
    assert "===== torchyard: attempt 1, rank 0/1" in text
    assert text.rstrip().endswith("trainer exited with code 0 =====")
    # No shared disk: the API's cache holds none of the job's files.
    api_cache = Path(c.settings().storage)
    assert not list(api_cache.rglob("output.log")) and not list(api_cache.rglob("*.pt"))
    # Every checkpoint on record is an object with its recorded sha256; pruned ones are gone.
    listed = c.get(f"/v1/jobs/{jid}/checkpoints")["items"]
    assert len([ck for ck in listed if ck["kind"] == "resume"]) == 2  # keep_last
    keys = {ck["path"]: hosts.store.checkpoint_key(jid, ck["path"], ck["sha256"]) for ck in listed}
    for ck in listed:
        info = hosts.store.stat(keys[ck["path"]])
        assert info.size == ck["bytes"] and info.sha256 == ck["sha256"]
    stored = {o.key for o in hosts.store.list(f"jobs/{jid}/checkpoints")}
    assert stored == {keys[ck["path"]] for ck in listed if ck["kind"] == "resume"}
    # The weights download through the API (streamed from the store) and match.
    client = Client(c.url, token=c.token)
    got = client.download(jid, "latest", tmp_path / "w.safetensors")
    weights = next(ck for ck in listed if ck["kind"] == "weights")
    assert hashlib.sha256(got.path.read_bytes()).hexdigest() == weights["sha256"]
    assert all(torch.equal(v, reference[k]) for k, v in load(got.path.read_bytes()).items())


def test_a_host_killed_mid_run_resumes_on_another_bitwise_equal(
    hosts: Hosts, reference: dict[str, torch.Tensor]
) -> None:
    c = hosts.c
    job = c.submit(LONG)
    trainer = trainer_pid(c, job["id"])  # now: the run may be near its end by step 60
    # Killed once its log reached the store (the worker ships it every second; a warm
    # trainer reaches step 60 sooner than that): what the host had not shipped dies with it.
    wait_for(lambda: "attempt 1, rank 0/1, worker a" in _rank_log(c, job["id"], 0), 60,
             "attempt 1's log in the store")  # fmt: skip
    wait_for(lambda: checkpointed_and_running(c, job["id"], 60), 120, "a checkpoint at step 60")
    victim = running_worker(c, job["id"])
    assert victim == "a"
    c.kill("a", signal.SIGKILL)
    wait_for(lambda: not pid_alive(trainer), 10, "the orphaned trainer to die")
    hosts.start("b")  # another host, another cache: it has none of the job's files
    assert not (hosts.cache("b") / "jobs").exists()
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    assert done["attempts"][1]["workers"][0]["worker_id"] == "b"
    log = _log(c, job["id"])
    assert "attempt 1, rank 0/1, worker a" in log and "attempt 2, rank 0/1, worker b" in log
    picked = log.split("resuming from ", 1)[1].split(" =====", 1)[0]
    # B fetched the checkpoint A picked into its own cache (and checked its sha256); its
    # trainer then went on and keep_last has pruned that file there by the end.
    assert (
        picked.startswith("checkpoints/step-") and (hosts.cache("b") / "jobs" / job["id"]).is_dir()
    )
    assert int(picked.split("-")[-1].split(".")[0]) < done["progress"]["total_steps"] - 60
    weights = _weights(hosts, job["id"])
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights)
    # The replayed steps were stored once each, with no gap.
    steps, _ = c.metrics(job["id"], "train/loss")
    assert steps == list(range(5, done["progress"]["total_steps"] + 1, 5))


def _rank_log(c: Cluster, job_id: str, rank: int) -> str:
    r = c.http.get(f"/v1/jobs/{job_id}/logs", params={"rank": rank, "limit": 1 << 20})
    assert r.status_code == 200, r.text
    return str(r.json()["data"])


def test_two_ranks_on_one_host_each_keep_their_own_log(hosts: Hosts) -> None:
    """Both ranks of a job on one host share its working copy: each still writes and ships
    its own log (one file, one appender each), so neither overwrites the other's lines."""
    c = hosts.c
    for name in ("a", "b"):
        if name in c.procs:  # the other hosts' workers go: both ranks land on host d
            c.kill(name, signal.SIGTERM)
            c.procs[name].wait(timeout=60)
    hosts.start("d0", host="d")
    hosts.start("d1", host="d")
    c.wait_workers(2)
    spec = LONG | {"world_size": 2, "epochs": 1, "batch_size": 64}
    done = c.wait_state(c.submit(spec)["id"], "succeeded", timeout=240)
    workers = {w["worker_id"] for w in done["attempts"][0]["workers"]}
    assert workers == {"d0", "d1"}
    for rank, other in ((0, 1), (1, 0)):
        text = _rank_log(c, done["id"], rank)
        assert f"attempt 1, rank {rank}/2" in text, (rank, text[:500])
        assert f"attempt 1, rank {other}/2" not in text
        assert "\x00" not in text
