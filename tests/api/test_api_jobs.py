"""Submit, list, show and cancel, through HTTP, on each database backend."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC, Factory

from torchyard.contracts import spec as job_spec
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics
from torchyard.store.states import QUEUED, RUNNING, STARTING, SUCCEEDED

JOB_KEYS = {
    "id", "name", "state", "attempt", "spec", "progress", "pending_reason", "error",
    "created_at", "updated_at", "started_at", "finished_at", "priority", "world_size",
    "max_restarts", "cancel_requested", "owner", "latest_metrics", "attempts",
    "project", "tags", "notes", "archived", "archived_at", "rerun_of", "sweep_id", "pruned",
}  # fmt: skip


def _error(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    if code:
        assert body["error"]["code"] == code
    return body["error"]


def test_submit_returns_the_normalised_job(client: TestClient, alice: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json=SPEC | {"name": "tiny", "priority": -5}, headers=alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert set(job) == JOB_KEYS | {"warnings"}  # the submit's answer only: what it noticed
    # SPEC's default batch of 128 is more than its 51 training samples: stored all the same
    assert [w["field"] for w in job.pop("warnings")] == ["batch_size"]
    assert job["state"] == QUEUED and job["attempt"] == 1 and job["owner"] == "alice"
    assert job["name"] == "tiny" and job["priority"] == -5 and job["world_size"] == 1
    # every default written out, as trainer.spec normalises it
    assert job["spec"] == job_spec.spec_to_dict(
        job_spec.parse_spec(SPEC | {"name": "tiny", "priority": -5})
    )
    assert job["progress"] is None and job["latest_metrics"] == {} and job["attempts"] == []
    # POST and GET answer with the same body for the same job
    again = client.get(f"/v1/jobs/{job['id']}", headers=alice)
    assert again.status_code == 200 and again.json() == job


def test_submit_names_every_problem_and_stores_nothing(
    client: TestClient, alice: dict[str, str]
) -> None:
    bad = copy.deepcopy(SPEC)
    bad["optimizer"]["lr"] = -1
    bad["batch_size"] = "many"
    bad["colour"] = "red"
    err = _error(client.post("/v1/jobs", json=bad, headers=alice), 422, "validation_error")
    fields = {d["field"] for d in err["details"]}
    assert {"optimizer.lr", "batch_size", "colour"} <= fields
    for f in ("optimizer.lr", "batch_size", "colour"):
        assert f in err["message"]
    assert client.get("/v1/jobs", headers=alice).json()["items"] == []


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
def test_submit_rejects_non_objects(client: TestClient, alice: dict[str, str], body: bytes) -> None:
    r = client.post("/v1/jobs", content=body, headers=alice | {"content-type": "application/json"})
    _error(r, 422, "validation_error")


def test_submit_checks_world_size_against_the_server(
    client: TestClient, alice: dict[str, str], app: Any
) -> None:
    app.state.settings = app.state.settings.model_copy(update={"max_world_size": 2})
    err = _error(
        client.post("/v1/jobs", json=SPEC | {"world_size": 4, "batch_size": 64}, headers=alice),
        422,
    )
    assert err["details"] == [{"field": "world_size", "message": err["details"][0]["message"]}]
    assert "<= 2" in err["message"]


def test_submit_refuses_a_dataset_not_on_disk(client: TestClient, alice: dict[str, str]) -> None:
    spec = SPEC | {"data": {"name": "mnist"}}
    err = _error(client.post("/v1/jobs", json=spec, headers=alice), 422)
    assert err["details"][0]["field"] == "data.name"
    assert "looked for" in err["message"] and "MNIST" in err["message"]
    assert client.get("/v1/jobs", headers=alice).json()["items"] == []


def test_idempotency_key(client: TestClient, alice: dict[str, str], bob: dict[str, str]) -> None:
    key = {"Idempotency-Key": "k-1"}
    first = client.post("/v1/jobs", json=SPEC, headers=alice | key)
    assert first.status_code == 201
    # key order and spelled-out defaults do not make a different spec
    same = job_spec.spec_to_dict(job_spec.parse_spec(SPEC))
    retry = client.post("/v1/jobs", json=dict(reversed(same.items())), headers=alice | key)
    assert retry.status_code == 200 and retry.json()["id"] == first.json()["id"]
    conflict = client.post("/v1/jobs", json=SPEC | {"epochs": 2}, headers=alice | key)
    err = _error(conflict, 409, "idempotency_conflict")
    assert err["details"]["job_id"] == first.json()["id"]
    # keys belong to their user
    other = client.post("/v1/jobs", json=SPEC, headers=bob | key)
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert len(client.get("/v1/jobs", headers=alice).json()["items"]) == 1


def test_list_newest_first_with_cursor_and_state_filter(
    client: TestClient, factory: Factory, alice: dict[str, str], bob: dict[str, str]
) -> None:
    ids = [factory.job("alice") for _ in range(5)]
    running = factory.job("alice", state=RUNNING)
    factory.job("bob")
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/jobs", params=params, headers=alice).json()
        assert len(page["items"]) <= 2
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [running, *reversed(ids)]
    only = client.get("/v1/jobs", params={"state": "running,starting"}, headers=alice).json()
    assert [j["id"] for j in only["items"]] == [running]
    rep = client.get("/v1/jobs?state=running&state=queued", headers=alice).json()
    assert len(rep["items"]) == 6
    _error(client.get("/v1/jobs", params={"state": "sleeping"}, headers=alice), 422)
    _error(client.get("/v1/jobs", params={"cursor": "garbage"}, headers=alice), 422)


def test_admin_sees_every_job(
    client: TestClient, factory: Factory, admin: dict[str, str], alice: dict[str, str]
) -> None:
    a, b = factory.job("alice"), factory.job("bob")
    items = client.get("/v1/jobs", headers=admin).json()["items"]
    assert {j["id"] for j in items} == {a, b}
    assert client.get(f"/v1/jobs/{b}", headers=admin).json()["owner"] == "bob"
    assert client.get(f"/v1/jobs/{b}", headers=alice).status_code == 404


def test_job_detail_shows_progress_metrics_and_attempts(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    progress = {"step": 40, "total_steps": 100, "epoch": 1.5, "samples_per_s": 900.0, "eta_s": 3.2}
    job_id = factory.job("alice", state=RUNNING, progress=progress, attempt=2)
    factory.attempt(job_id, number=1, workers=2, state="lost", exit_code=-9, reason="worker lost")
    factory.attempt(job_id, number=2, workers=1, rank0_endpoint="10.0.0.1:29500")
    with session_scope(db_url) as s:
        rows = [
            {"name": "train/loss", "step": k, "value": 1.0 / (k + 1), "time": 0.0}
            for k in range(50)
        ]
        rows.append({"name": "val/accuracy", "step": 20, "value": 0.75, "time": 0.0})
        ingest_metrics(s, job_id, rows)
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert job["progress"] == progress and job["attempt"] == 2
    assert job["latest_metrics"] == {
        "train/loss": {"step": 49, "value": 1.0 / 50},
        "val/accuracy": {"step": 20, "value": 0.75},
    }
    first, second = job["attempts"]
    assert first["number"] == 1 and first["state"] == "lost" and first["exit_code"] == -9
    assert [w["rank"] for w in first["workers"]] == [0, 1] and first["reason"] == "worker lost"
    assert second["rank0_endpoint"] == "10.0.0.1:29500" and len(second["workers"]) == 1
    assert set(first) == {
        "number", "state", "workers", "rank0_endpoint", "exit_code", "reason",
        "created_at", "started_at", "ended_at",
    }  # fmt: skip
    assert job["started_at"] is not None and job["finished_at"] is None


@pytest.mark.parametrize(
    ("state", "after"),
    [(QUEUED, "cancelled"), (STARTING, "cancelling"), (RUNNING, "cancelling")],
)
def test_cancel(
    client: TestClient, factory: Factory, alice: dict[str, str], state: str, after: str
) -> None:
    job_id = factory.job("alice", state=state)
    factory.attempt(job_id, number=1, workers=2)
    before = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=alice)
    assert r.status_code == 202, r.text
    cancelled = r.json()
    assert cancelled["state"] == after and cancelled["cancel_requested"] is True
    # the cancel's body is the job as GET shows it: all but what the cancel changed is as
    # before, and a GET right after shows exactly it
    changed = {"state", "cancel_requested", "updated_at", "finished_at"}
    assert {k for k in JOB_KEYS if cancelled[k] != before[k]} <= changed
    assert cancelled["attempts"] == before["attempts"] and len(cancelled["attempts"]) == 1
    assert client.get(f"/v1/jobs/{job_id}", headers=alice).json() == cancelled
    again = client.post(f"/v1/jobs/{job_id}/cancel", headers=alice)
    assert again.status_code == 202 and again.json() == cancelled


@pytest.mark.parametrize("state", [SUCCEEDED, "failed"])
def test_cancel_of_a_finished_job_is_409(
    client: TestClient, factory: Factory, alice: dict[str, str], state: str
) -> None:
    job_id = factory.job("alice", state=state)
    err = _error(client.post(f"/v1/jobs/{job_id}/cancel", headers=alice), 409, "illegal_transition")
    assert err["details"]["state"] == state
    assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["state"] == state


def test_body_over_the_limit_is_413(client: TestClient, alice: dict[str, str], app: Any) -> None:
    limit = app.state.settings.max_body_bytes
    big = SPEC | {"name": "x", "pad": "y" * (limit + 10)}
    err = _error(client.post("/v1/jobs", json=big, headers=alice), 413, "payload_too_large")
    assert str(limit) in err["message"]

    def chunks():  # no Content-Length: the limit still holds while streaming
        for _ in range(limit // 1000 + 5):
            yield b" " * 1000

    r = client.post(
        "/v1/jobs", content=chunks(), headers=alice | {"content-type": "application/json"}
    )
    _error(r, 413, "payload_too_large")


def test_non_finite_latest_metric_is_null(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job_id = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(
            s, job_id, [{"name": "train/loss", "step": 3, "value": float("inf"), "time": 0.0}]
        )
    r = client.get(f"/v1/jobs/{job_id}", headers=alice)
    assert r.status_code == 200
    assert r.json()["latest_metrics"] == {"train/loss": {"step": 3, "value": None}}
