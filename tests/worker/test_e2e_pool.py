"""Sharing the pool, end to end with real processes (`torchyard api`, a scheduler, two CPU
workers) on the embedded defaults and on PostgreSQL + Redis: fair share between two users,
quotas (pending reason, 429, 403), and a preemption whose resumed job ends with weights
bitwise equal to the same spec run without interruption."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import select
from support.worker_cluster import (
    REDIS_POSTGRES,
    Cluster,
    backend_cluster,
    checkpointed_and_running,
    job_weights,
    wait_for,
)

from torchyard.store.models import JobEvent

pytestmark = pytest.mark.e2e

# A few seconds of training each (~1.5 s of steps: a warm slot starts one in ~0.2 s), so
# eight of them queue up behind two workers for longer than their submits take.
SHORT: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [512, 512]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 6400, "num_workers": 0},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "batch_size": 32,
    "max_steps": 400,
    "checkpoint": {"every_epochs": None, "every_steps": None, "keep_last": 1},
}
# Long enough (800 steps, several seconds on one CPU thread) to be preempted mid-run, with a resume
# checkpoint every 40 steps and every step's loss kept.
LONG: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [512, 512]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 6400, "num_workers": 0},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    # 2000 steps, ~7 s: the victim and the reference still run when the urgent job comes
    # (one of them may have started cold, ~3 s after the other).
    "epochs": 10,
    "checkpoint": {"every_steps": 40, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 1,
    "eval_every_epochs": 0,
    "precision": "fp32",
    "seed": 5,
}


@pytest.fixture(scope="module", params=[REDIS_POSTGRES])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    yield from backend_cluster(
        request, tmp_path_factory, extra_env={"TORCHYARD_PREEMPT_AFTER_S": "0"}
    )


@pytest.fixture(scope="module")
def users(cluster: Cluster) -> Iterator[dict[str, httpx.Client]]:
    from torchyard.store.auth import create_token

    out = {}
    for name in ("alice", "bob"):
        with cluster.session() as s:
            token = create_token(s, name)
        out[name] = httpx.Client(
            base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
    yield out
    for client in out.values():
        client.close()


def submit(client: httpx.Client, spec: dict[str, Any], name: str) -> str:
    r = client.post("/v1/jobs", json={**spec, "name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def started_at(c: Cluster, job_id: str) -> datetime:
    j = c.wait_state(job_id, "succeeded", timeout=180)
    return datetime.fromisoformat(j["attempts"][0]["created_at"])


def test_the_second_user_does_not_wait_for_the_first_users_backlog(
    cluster: Cluster, users: dict[str, httpx.Client]
) -> None:
    c = cluster
    alice = [submit(users["alice"], SHORT, f"alice-{i}") for i in range(6)]
    bob = [submit(users["bob"], SHORT, f"bob-{i}") for i in range(2)]
    # Each job's start is its attempt's creation, by the one scheduler.
    starts = {j: started_at(c, j) for j in alice + bob}
    assert starts[bob[0]] < starts[alice[3]], {j: str(t) for j, t in starts.items()}
    assert starts[bob[1]] < starts[alice[5]]


def test_quotas_hold_a_user_back_refuse_a_submit_and_are_for_admins(
    cluster: Cluster, users: dict[str, httpx.Client]
) -> None:
    c, alice, bob = cluster, users["alice"], users["bob"]
    r = c.http.put("/v1/users/alice/quota", json={"max_workers": 1})
    assert r.status_code == 200, r.text
    first = submit(alice, LONG, "alice-long-1")
    c.wait_state(first, "running")
    second = submit(alice, LONG, "alice-long-2")
    why = wait_for(
        lambda: "quota" in (r := c.job(second)["pending_reason"] or "") and r, 30, "a quota reason"
    )
    assert "max_workers 1" in why, why
    assert c.job(second)["state"] == "queued"  # although a worker is idle
    assert c.http.put("/v1/users/alice/quota", json={"max_queued": 1}).status_code == 200
    r = alice.post("/v1/jobs", json={**SHORT, "name": "one-too-many"})
    assert r.status_code == 429, r.text
    assert "max_queued" in r.json()["error"]["message"]
    r = bob.put("/v1/users/bob/quota", json={"max_workers": 100})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    for job_id in (first, second):
        assert alice.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        c.wait_state(job_id, "cancelled", timeout=60)
    r = c.http.put("/v1/users/alice/quota", json={"max_workers": None, "max_queued": None})
    assert r.json()["max_workers"] is None and r.json()["max_queued"] is None


def test_a_preempted_job_resumes_bitwise_and_says_who_preempted_it(
    cluster: Cluster, users: dict[str, httpx.Client]
) -> None:
    c, bob = cluster, users["bob"]
    c.wait_workers(2)
    # The reference may not be preempted, so the victim is the only candidate. It starts
    # second, so it is still running when the urgent job comes (had it finished first, the
    # urgent job would take its worker and preempt no one).
    victim = submit(bob, LONG, "victim")
    reference = submit(bob, {**LONG, "preemptible": False}, "reference")
    wait_for(
        lambda: checkpointed_and_running(c, victim, 40) and c.job(reference)["state"] == "running",
        180,
        "a checkpoint at 40 and the reference running",
    )
    urgent = c.submit({**SHORT, "name": "urgent", "priority": 5})["id"]
    c.wait_state(urgent, "succeeded", timeout=120)
    done = c.wait_state(victim, "succeeded", timeout=240)
    first, last = done["attempts"]
    assert first["state"] == "handed_back", first
    # The urgent job is another user's (the admin's): its id is not bob's to see.
    assert urgent not in first["reason"]
    assert first["reason"].startswith("preempted by another job at step "), first["reason"]
    assert last["state"] == "succeeded"
    ref = c.wait_state(reference, "succeeded", timeout=240)
    assert [a["state"] for a in ref["attempts"]] == ["succeeded"]
    a, b = job_weights(c, reference), job_weights(c, victim)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps, _ = c.metrics(victim, "train/loss")
    assert steps == list(range(1, done["progress"]["total_steps"] + 1))
    with c.session() as s:
        preempted = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == victim, JobEvent.type == "preempted")
        ).all()
    assert preempted == [{"by": urgent, "attempt": 1}]
