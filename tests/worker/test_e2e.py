"""End to end, real processes: `torchyard api`, two `torchyard scheduler`s racing each
other and two CPU workers, jobs posted over REST. Runs on the embedded defaults (SQLite +
filesystem broker) and on PostgreSQL + Redis (tests/BACKENDS.md: a job handed back goes
through the broker and the scheduler's locks, which the shapes do differently); the two
tests whose subject is training itself run on one shape each (`on_shapes`). One cluster per
shape is shared by the tests of this module (two cores), and every test leaves it with its
two workers idle."""

from __future__ import annotations

import hashlib
import io
import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sklearn.datasets import load_digits
from specs import digits_spec
from sqlalchemy import select
from support.backends import on_shapes
from support.worker_cluster import (
    BOTH_SHAPES,
    Cluster,
    backend_cluster,
    checkpointed_and_running,
    job_events,
    job_weights,
    pid_alive,
    processes_mentioning,
    running_worker,
    trainer_pid,
    wait_for,
)

import torchyard

pytestmark = pytest.mark.e2e

DIGITS: dict[str, Any] = digits_spec(epochs=3, log_every_steps=1, seed=3)
# Long enough (~ several seconds of training on one CPU thread) to be killed mid-epoch,
# with a resume checkpoint every 40 steps.
LONG: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [1024, 1024]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 6000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 4,
    "checkpoint": {"every_steps": 40, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 5,
    "seed": 11,
}


@pytest.fixture(scope="module", params=BOTH_SHAPES)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    # Two schedulers race on every wake-up and tick: none may double-assign.
    yield from backend_cluster(request, tmp_path_factory, schedulers=2)


def _downloaded_weights_load_and_score(c: Cluster, job: dict, tmp: Path) -> None:
    """The final weights, downloaded, come back as a model with torchyard.load_model that
    takes digits' raw 0..16 values and scores on the whole set at least the job's own
    val/accuracy."""
    r = c.http.get(f"/v1/jobs/{job['id']}/checkpoints/latest/download", params={"kind": "weights"})
    assert r.status_code == 200, r.text
    (tmp / "model.safetensors").write_bytes(r.content)
    model = torchyard.load_model(tmp / "model.safetensors")
    digits = load_digits()
    with torch.no_grad():
        pred = model(torch.from_numpy(digits.images[:, None])).argmax(1).numpy()
    accuracy = float((pred == digits.target).mean())
    assert accuracy >= job["latest_metrics"]["val/accuracy"]["value"], accuracy


@on_shapes("embedded")  # the quick start's shape; training and download are the subject
def test_digits_job_trains_and_its_checkpoint_downloads(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    job = c.submit(DIGITS)
    assert job["state"] == "queued"
    done = c.wait_state(job["id"], "succeeded")
    assert done["attempt"] == 1 and done["attempts"][0]["exit_code"] == 0
    assert done["progress"]["step"] == done["progress"]["total_steps"] > 0
    steps, losses = c.metrics(job["id"], "train/loss")
    assert len(steps) == len(set(steps)) > 10
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first * 0.7, (first, last)
    # The latest resume checkpoint: its bytes hash to the advertised sha256 and it loads
    # without pickle code execution.
    cks = [ck for ck in c.get(f"/v1/jobs/{job['id']}/checkpoints")["items"]]
    assert cks
    r = c.http.get(f"/v1/jobs/{job['id']}/checkpoints/latest/download")
    assert r.status_code == 200
    digest = hashlib.sha256(r.content).hexdigest()
    assert digest in {ck["sha256"] for ck in cks}
    assert r.headers.get("etag", "").strip('"') == digest
    state = torch.load(io.BytesIO(r.content), weights_only=True, map_location="cpu")
    assert isinstance(state, dict) and state
    _downloaded_weights_load_and_score(c, done, tmp_path)
    log = c.job_log(job["id"])
    assert "attempt 1, rank 0/1" in log


@on_shapes("redis-postgres")  # a production pool's shape; DDP's numbers are the subject
def test_world_size_2_matches_world_size_1(cluster: Cluster) -> None:
    c = cluster
    one = c.submit(dict(DIGITS, world_size=1))
    two = c.submit(dict(DIGITS, world_size=2))
    c.wait_state(one["id"], "succeeded")
    j2 = c.wait_state(two["id"], "succeeded", timeout=180)
    a = j2["attempts"][0]
    assert sorted(w["rank"] for w in a["workers"]) == [0, 1]
    assert len({w["worker_id"] for w in a["workers"]}) == 2
    assert a["rank0_endpoint"]
    w1, w2 = job_weights(c, one["id"]), job_weights(c, two["id"])
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-4, rtol=1e-3), k
    _, l1 = c.metrics(one["id"], "val/loss")
    _, l2 = c.metrics(two["id"], "val/loss")
    assert abs(l1[-1] - l2[-1]) < 1e-3


def test_a_rank_that_fails_alone_fails_the_job_once_with_its_cause(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Rank 1's host lacks the data set. Its trainer used to exit 1 without a word to its
    worker, which counted a retryable failure: the job ran max_restarts + 1 times while
    rank 0 hung in a collective. Now rank 1 reports `data` to its own worker, the job fails
    at once, and rank 0 (whose peer is gone) is stopped."""
    import importlib.util

    lib = Path(__file__).resolve().parents[1] / "trainer" / "trainer_testlib.py"
    spec_ = importlib.util.spec_from_file_location("trainer_testlib_e2e", lib)
    assert spec_ is not None and spec_.loader is not None
    testlib = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(testlib)
    c = cluster
    testlib.write_mnist(Path(c.settings().data), n_train=600, n_test=100, gz=True)
    empty = tmp_path / "no-data"
    empty.mkdir()
    c.kill("w1", signal.SIGTERM)
    c.procs["w1"].wait(timeout=60)
    c.start_worker("w1", env={"TORCHYARD_DATA_ROOT": str(empty)})
    try:
        c.wait_workers(2)
        job = c.submit(dict(DIGITS, data={"name": "mnist"}, world_size=2, max_restarts=2))
        done = c.wait_state(job["id"], "failed", timeout=120)
        assert len(done["attempts"]) == 1, done["attempts"]  # not retried: deterministic
        assert done["error"].startswith("rank 1: data:") and "mnist" in done["error"].lower()
        c.wait_workers(2)  # rank 0's trainer did not hang: both workers are free again
    finally:
        c.kill("w1", signal.SIGTERM)
        c.procs["w1"].wait(timeout=60)
        c.start_worker("w1")
        c.wait_workers(2)


def test_big_gang_waits_without_blocking_a_small_job(cluster: Cluster) -> None:
    c = cluster
    big = c.submit(dict(DIGITS, world_size=3, batch_size=63, priority=5))
    small = c.submit(DIGITS)
    c.wait_state(small["id"], "succeeded")
    j = c.job(big["id"])
    assert j["state"] == "queued"
    assert j["pending_reason"] == "needs 3 workers, 2 registered"
    r = c.http.post(f"/v1/jobs/{big['id']}/cancel")
    assert r.status_code == 202
    c.wait_state(big["id"], "cancelled")


def test_a_duplicated_task_message_starts_one_trainer(cluster: Cluster) -> None:
    from torchyard.broker.app import RUN_TASK, make_celery, worker_queue
    from torchyard.store.models import Assignment

    c = cluster
    settings = c.settings()
    app = make_celery(settings)
    job = c.submit(dict(DIGITS, epochs=6))

    def assignment() -> tuple[int, str] | None:
        with c.session() as s:
            row = s.execute(
                select(Assignment.id, Assignment.worker_id).where(Assignment.job_id == job["id"])
            ).first()
        return (row[0], row[1]) if row else None

    aid, wid = wait_for(assignment, 60, "the job's assignment")
    other = "w1" if wid == "w0" else "w0"
    # The same message again, twice to its worker and once to another worker.
    for target in (wid, wid, other):
        app.send_task(RUN_TASK, args=[aid], queue=worker_queue(settings, target))
    c.wait_state(job["id"], "succeeded")
    marker = f"assignment {aid}: not claimable here"
    wait_for(
        lambda: c.log_of(wid).count(marker) + c.log_of(other).count(marker) >= 3,
        60,
        "the duplicates to be delivered and ignored",
    )
    started = [e for e in job_events(c, job["id"]) if e["type"] == "started"]
    assert len(started) == 1
    assert c.job_log(job["id"]).count("===== torchyard: attempt 1, rank 0/1, worker") == 1
    assert len(c.job(job["id"])["attempts"]) == 1
    c.wait_workers(2)


def test_cancel_ends_a_running_job_within_5s(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(LONG)
    c.wait_state(job["id"], "running", timeout=120)
    pid = trainer_pid(c, job["id"])
    wait_for(lambda: checkpointed_and_running(c, job["id"], 40), 120, "a first checkpoint")
    t0 = time.monotonic()
    r = c.http.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202
    c.wait_state(job["id"], "cancelled", timeout=5)
    assert time.monotonic() - t0 < 5
    from torchyard.store.paths import job_dir

    assert not pid_alive(pid)
    assert processes_mentioning(str(job_dir(c.storage, job["id"]))) == []
    # What it saved stays downloadable.
    r = c.http.get(f"/v1/jobs/{job['id']}/checkpoints/latest/download")
    assert r.status_code == 200 and r.content
    c.wait_workers(2)


@pytest.fixture(scope="module")
def long_ref(cluster: Cluster) -> dict[str, torch.Tensor]:
    """The final weights of LONG run without interruption on this cluster."""
    ref = cluster.submit(LONG)
    cluster.wait_state(ref["id"], "succeeded", timeout=180)
    return job_weights(cluster, ref["id"])


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigkilled_worker_job_resumes_elsewhere_bitwise_equal(
    cluster: Cluster, long_ref: dict[str, torch.Tensor]
) -> None:
    c = cluster

    job = c.submit(LONG)
    wait_for(lambda: checkpointed_and_running(c, job["id"], 80), 120, "a checkpoint at step 80")
    victim = running_worker(c, job["id"])
    trainer = trainer_pid(c, job["id"])
    step_at_kill = max(ck["step"] for ck in c.get(f"/v1/jobs/{job['id']}/checkpoints")["items"])
    c.kill(victim, signal.SIGKILL)
    # The parent-death signal takes the trainer down with its worker.
    wait_for(lambda: not pid_alive(trainer), 10, "the orphaned trainer to die")
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    first, second = done["attempts"][0], done["attempts"][1]
    assert first["state"] == "lost" and "no heartbeat" in first["reason"]
    assert second["workers"][0]["worker_id"] != victim
    assert done["attempt"] == 2 and step_at_kill < done["progress"]["total_steps"]
    assert "resuming from checkpoints/step-" in c.job_log(job["id"])
    # Exact resume: the same final weights as the uninterrupted run, bit for bit.
    _assert_bitwise(long_ref, job_weights(c, job["id"]))
    # The replayed steps were stored once each, with no gap.
    steps, _ = c.metrics(job["id"], "train/loss")
    total = done["progress"]["total_steps"]
    assert steps == list(range(5, total + 1, 5))
    c.start_worker(victim)
    c.wait_workers(2)


def _started_elsewhere(c: Cluster, job_id: str, victim: str) -> bool:
    from torchyard.store.models import Assignment

    with c.session() as s:
        pids = s.scalars(
            select(Assignment.pid).where(
                Assignment.job_id == job_id,
                Assignment.worker_id != victim,
                Assignment.pid.is_not(None),
            )
        ).all()
    return bool(pids)


def test_frozen_worker_trainer_stops_before_the_job_runs_elsewhere(
    cluster: Cluster, long_ref: dict[str, torch.Tensor]
) -> None:
    """A worker frozen (SIGSTOP) for longer than the heartbeat timeout used to leave its
    trainer running while the reaper started the job again on the same run directory: two
    attempts at once. Now the trainer's lease goes stale, it checkpoints and stops by
    itself before the job can be given away; the job resumes elsewhere, bitwise exact, and
    the frozen worker, once thawed, writes nothing for the old attempt and comes back."""
    c = cluster
    job = c.submit(LONG)
    wait_for(lambda: checkpointed_and_running(c, job["id"], 40), 120, "a first checkpoint")
    victim = running_worker(c, job["id"])
    trainer = trainer_pid(c, job["id"])
    c.kill(victim, signal.SIGSTOP)
    try:
        wait_for(lambda: not pid_alive(trainer), 10, "the trainer to stop on its stale lease")
        wait_for(lambda: c.job(job["id"])["attempt"] == 2, 60, "the job to be re-queued")
        # Thawed only once attempt 2's trainer has the run directory (a warm one took it
        # over by name): the frozen worker, back, must leave that name alone.
        wait_for(lambda: _started_elsewhere(c, job["id"], victim), 120, "attempt 2's trainer")
    finally:
        c.kill(victim, signal.SIGCONT)
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    first = done["attempts"][0]
    assert first["state"] == "lost", first
    events = job_events(c, job["id"])
    stopped = [e for e in events if e["type"] == "stopped" and e.get("attempt") == 1]
    assert stopped and stopped[0]["signal"] == "lease expired"
    last_of_first = max(e["time"] for e in events if e.get("attempt") == 1)
    first_of_second = min(e["time"] for e in events if e.get("attempt") == 2)
    assert last_of_first < first_of_second  # never two attempts at once
    _assert_bitwise(long_ref, job_weights(c, job["id"]))
    steps, _ = c.metrics(job["id"], "train/loss")
    assert steps == list(range(5, done["progress"]["total_steps"] + 1, 5))
    c.wait_workers(2)


def test_sigterm_worker_hands_its_job_back(cluster: Cluster) -> None:
    c = cluster
    job = c.submit(LONG)
    wait_for(lambda: checkpointed_and_running(c, job["id"], 40), 120, "a first checkpoint")
    victim = running_worker(c, job["id"])
    c.kill(victim, signal.SIGTERM)
    assert c.procs[victim].wait(timeout=60) == 0
    done = c.wait_state(job["id"], "succeeded", timeout=240)
    first = done["attempts"][0]
    assert first["state"] == "handed_back", first
    assert first["exit_code"] == 75
    workers = {w["id"]: w for w in c.get("/v1/workers")["items"]}
    assert workers[victim]["state"] == "stopped"
    c.start_worker(victim)
    c.wait_workers(2)


def test_no_worker_ever_ran_two_assignments_at_once(cluster: Cluster) -> None:
    """Over everything this module ran with two schedulers: per worker, the assignments'
    [created, ended] intervals never overlap, and each job's attempts are numbered once."""
    from torchyard.store.models import Assignment, Attempt

    with cluster.session() as s:
        rows = s.execute(
            select(Assignment.worker_id, Assignment.created_at, Assignment.ended_at).order_by(
                Assignment.worker_id, Assignment.created_at
            )
        ).all()
        numbers = s.execute(select(Attempt.job_id, Attempt.number)).all()
    assert len(rows) > 10
    for (w1, _, end1), (w2, start2, _) in itertools.pairwise(rows):
        if w1 == w2:
            assert end1 is not None and end1 <= start2, (w1, end1, start2)
    assert len(numbers) == len(set(numbers))
