"""Sweeps end to end with real processes (`torchyard api`, a scheduler running the sweep
controller, two CPU workers) on the embedded defaults and on PostgreSQL + Redis: ASHA
prunes a trial at its first rung, where it waited for the verdict (it trains no step
past it), and the best trial is reported; synchronous halving pauses trials at the rung
with their workers freed and resumes the one it keeps; a sweep cancelled midway leaves no
trial running, its trials `cancelled`, and starts no new one; a script sweep over
`params.lr` runs each trial with its value in `job.params()`, found by `?param=` and shown in
the dashboard's rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from support.worker_cluster import REDIS_POSTGRES, Cluster, backend_cluster, wait_for

from torchyard.client.sdk import Client
from torchyard.store.models import Job, JobEvent, Metric

pytestmark = pytest.mark.e2e

# Digits with a wide MLP: ~0.3 s an epoch on one CPU thread; 90 steps an epoch.
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [1024, 1024]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "batch_size": 16,
    "epochs": 14,
    "checkpoint": {"every_epochs": 1, "keep_last": 1},
}
# Seed 3 walks the grid as 1e-4, 0.05, 1e-5: trial 0 is first at every rung, trial 1 the
# best at every rung, trial 2 (val/accuracy ~0.1 after one epoch, against trial 1's ~0.95)
# is pruned at its first evaluation (rung 1).
ASHA: dict[str, Any] = {
    "name": "asha-e2e",
    "spec": SPEC,
    "space": {"optimizer.lr": {"type": "categorical", "choices": [0.05, 0.0001, 0.00001]}},
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 3,
    "parallel": 1,
    "sampler": "grid",
    "pruner": "asha",
    "seed": 3,
}


@pytest.fixture(scope="module", params=[REDIS_POSTGRES])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    yield from backend_cluster(request, tmp_path_factory)


@pytest.fixture(scope="module")
def sdk(cluster: Cluster) -> Iterator[Client]:
    with Client(url=cluster.url, token=cluster.token) as client:
        yield client


def wait_sweep(sdk: Client, sweep_id: str, timeout: float) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        s = sdk.get_sweep(sweep_id)
        return s if s["state"] != "running" and s["counts"]["running"] == 0 else None

    return wait_for(ended, timeout, f"sweep {sweep_id} to end", every=0.5)


def test_asha_prunes_a_trial_and_reports_the_best(cluster: Cluster, sdk: Client) -> None:
    sweep = wait_sweep(sdk, sdk.create_sweep(ASHA)["id"], timeout=180)
    trials = sweep["trials"]
    assert [t["params"]["optimizer.lr"] for t in trials] == [0.0001, 0.05, 0.00001]
    assert [(t["status"], t["state"]) for t in trials] == [
        ("complete", "succeeded"), ("complete", "succeeded"), ("pruned", "cancelled")
    ], [cluster.job(t["job_id"])["error"] for t in trials]  # fmt: skip
    assert sweep["state"] == "succeeded" and sweep["counts"]["pruned"] == 1
    best = trials[1]
    assert sweep["best"] == {k: best[k] for k in ("number", "job_id", "params", "value")}
    assert best["value"] > 0.9 and best["step"] == 14 * 90
    pruned = trials[2]
    assert pruned["pruned"] and pruned["step"] == 90
    job = cluster.job(pruned["job_id"])
    assert job["attempts"][-1]["reason"].startswith("pruned at step 90: val/accuracy")
    with cluster.session() as s:
        last = s.scalar(select(func.max(Metric.step)).where(Metric.job_id == pruned["job_id"]))
        assert last == 90, "it trained past its rung"
        reasons = s.scalars(select(JobEvent.data).where(JobEvent.job_id == pruned["job_id"]))
        assert any(d.get("to") == "cancelling" and d["reason"].startswith("pruned at step 90")
                   for d in reasons)  # fmt: skip


def test_halving_pauses_trials_frees_their_workers_and_resumes_the_best(
    cluster: Cluster, sdk: Client
) -> None:
    """Synchronous halving on the same grid: trial 0 and trial 1 are each paused at rung 1
    (a later trial could still beat them there), handed back with a checkpoint, and trial 2
    starts meanwhile (paused trials hold no slot of `parallel: 1`); trial 2 is pruned
    there as the worst of three, the controller prunes paused trial 0 and releases trial 1,
    which resumes from its rung's checkpoint and completes."""
    body = {**ASHA, "name": "halving-e2e", "pruner": "halving", "spec": {**SPEC, "epochs": 6}}
    sweep = wait_sweep(sdk, sdk.create_sweep(body)["id"], timeout=240)
    t0, t1, t2 = sweep["trials"]
    jobs = [cluster.job(t["job_id"]) for t in (t0, t1, t2)]
    assert [(t["status"], t["state"]) for t in (t0, t1, t2)] == [
        ("pruned", "cancelled"), ("complete", "succeeded"), ("pruned", "cancelled")
    ], [j["error"] for j in jobs]  # fmt: skip
    assert sweep["state"] == "succeeded" and sweep["best"]["number"] == t1["number"]
    paused = [j["attempts"][0]["reason"] for j in jobs[:2]]
    assert all(r.startswith("paused at step 90: val/accuracy") for r in paused), paused
    assert [a["state"] for a in jobs[1]["attempts"]] == ["handed_back", "succeeded"]
    assert t1["value"] > 0.9 and t1["step"] == 6 * 90
    for t in (t0, t2):
        assert (t["step"], t["paused_at"]) == (90, None)
    assert "synchronous halving" in jobs[0]["attempts"][0]["reason"]
    with cluster.session() as s:
        for t in (t0, t2):  # neither trained past its rung
            last = s.scalar(select(func.max(Metric.step)).where(Metric.job_id == t["job_id"]))
            assert last == 90
        reasons = s.scalars(select(JobEvent.data).where(JobEvent.job_id == t0["job_id"]))
        assert any(d.get("to") == "cancelled" and d["reason"].startswith("pruned at step 90")
                   for d in reasons)  # fmt: skip
    # Trial 1 went on from its checkpoint at the rung: its second attempt trained the rest.
    steps, loss = cluster.metrics(t1["job_id"], "train/loss")
    assert loss and steps == sorted(set(steps)) and max(steps) == 6 * 90


def test_a_cancelled_sweep_leaves_no_trial_running_and_starts_none(
    cluster: Cluster, sdk: Client
) -> None:
    body = {**ASHA, "name": "cancel-e2e", "sampler": "random", "pruner": "none", "trials": 6,
            "parallel": 2, "spec": {**SPEC, "epochs": 200}}  # fmt: skip
    sweep_id = sdk.create_sweep(body)["id"]

    def started() -> bool:
        trials = sdk.get_sweep(sweep_id)["trials"]
        return len(trials) == 2 and any(t["state"] == "running" for t in trials)

    wait_for(started, 60, "two trials, one running", every=0.2)
    assert sdk.cancel_sweep(sweep_id)["state"] == "cancelled"
    sweep = wait_sweep(sdk, sweep_id, timeout=60)
    time.sleep(2.5)  # another tick of the controller: nothing new may start
    with cluster.session() as s:
        jobs = s.scalars(select(Job.state).where(Job.sweep_id == sweep_id)).all()
    assert sorted(jobs) == ["cancelled", "cancelled"]
    sweep = sdk.get_sweep(sweep_id)
    assert sweep["state"] == "cancelled" and len(sweep["trials"]) == 2
    assert {t["status"] for t in sweep["trials"]} == {"cancelled"}
    assert sweep["best"] is None


# A script whose objective is its `lr` param's distance from 0.1: what job.params() gave it.
PARAMS_SCRIPT = """\
from torchyard import job
p = job.params()
job.setup(total_steps=2)
for step in (1, 2):
    job.log(step, score=1.0 - abs(p["lr"] - 0.1), wide=float(p["arch"] == "wide"))
"""


def test_a_script_sweep_over_params_runs_each_trial_with_its_values(
    cluster: Cluster, sdk: Client, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(PARAMS_SCRIPT)
    body = {"name": "params-e2e", "spec": {"entrypoint": {"script": "train.py"},
            "params": {"arch": "wide"}}, "space": {"params.lr": {"type": "categorical",
            "choices": [0.1, 0.01]}}, "objective": {"metric": "score", "mode": "max"},
            "trials": 2, "parallel": 2, "sampler": "grid", "pruner": "none"}  # fmt: skip
    sweep = wait_sweep(sdk, sdk.create_sweep(body, code=tmp_path)["id"], timeout=60)
    assert sweep["state"] == "succeeded", [
        cluster.job(t["job_id"])["error"] for t in sweep["trials"]
    ]
    values = {t["params"]["params.lr"]: t["value"] for t in sweep["trials"]}
    assert values == {0.1: 1.0, 0.01: pytest.approx(0.91)}
    for t in sweep["trials"]:
        job = cluster.job(t["job_id"])
        assert job["spec"]["params"] == {"arch": "wide", "lr": t["params"]["params.lr"]}
        assert job["latest_metrics"]["wide"]["value"] == 1.0
    found = cluster.http.get("/v1/jobs", params={"param": "lr:0.1"}).json()["items"]
    assert [j["id"] for j in found] == [sweep["best"]["job_id"]]
    rows = cluster.http.get("/v1/ui/jobs").json()["items"]
    shown = {r["id"]: r["params"] for r in rows if r["sweep_id"] == sweep["id"]}
    assert sorted(p["lr"] for p in shown.values()) == [0.01, 0.1]
