"""GET /v1/queue on each database backend: the order jobs would start in (priority, then fair
share by usage / share, then age), what each caller may see, and the usage it reports."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC, Factory

from torchyard.store.models import utcnow
from torchyard.store.states import SUCCEEDED

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

HALF_LIFE_S = 86_400.0  # Settings' default, which the fixtures keep


def _used(factory: Factory, owner: str, start_h: float, end_h: float, workers: int = 1) -> float:
    """A finished job of `owner` whose attempt held `workers` from `start_h` to `end_h` hours
    ago; returns the decayed worker-hours it adds (store/usage.py's formula)."""
    now = utcnow()
    job = factory.job(owner, state=SUCCEEDED)
    factory.attempt(
        job, workers=workers, state="succeeded",
        started_at=now - timedelta(hours=start_h), ended_at=now - timedelta(hours=end_h),
    )  # fmt: skip
    k = math.log(2) / HALF_LIFE_S
    return workers * (math.exp(-k * end_h * 3600) - math.exp(-k * start_h * 3600)) / k / 3600


@pytest.fixture
def queue(factory: Factory) -> dict[str, Any]:
    """alice used 1 worker for an hour lately, bob for half an hour; four queued jobs."""
    used = {"alice": _used(factory, "alice", 2, 1), "bob": _used(factory, "bob", 1.5, 1)}
    t0 = utcnow().replace(microsecond=0) - timedelta(minutes=10)
    ids = {}
    for i, (name, owner, priority) in enumerate(
        [("a1", "alice", 0), ("b1", "bob", 0), ("a2", "alice", 5), ("b2", "bob", 0)]
    ):
        ids[name] = factory.job(
            owner, spec=SPEC | {"name": name, "priority": priority},
            created_at=t0 + timedelta(seconds=i),
        )  # fmt: skip
    return {"ids": ids, "used": used, "t0": t0}


def _get(client: TestClient, headers: dict[str, str], **params: Any) -> dict[str, Any]:
    r = client.get("/v1/queue", headers=headers, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_priority_first_then_the_user_who_used_less(
    client: TestClient, admin: dict[str, str], queue: dict[str, Any]
) -> None:
    body = _get(client, admin)
    ids = queue["ids"]
    # a2 outranks everything; then bob's jobs (0.5 h used) before alice's older a1 (1 h)
    assert [i["id"] for i in body["items"]] == [ids["a2"], ids["b1"], ids["b2"], ids["a1"]]
    assert [i["position"] for i in body["items"]] == [1, 2, 3, 4]
    first = body["items"][0]
    assert first["name"] == "a2" and first["owner"] == "alice" and first["priority"] == 5
    assert first["world_size"] == 1 and first["pending_reason"] is None
    assert datetime.fromisoformat(first["created_at"]) == queue["t0"] + timedelta(seconds=2)
    assert first["usage"]["share"] == 1.0
    assert first["usage"]["worker_hours"] == pytest.approx(queue["used"]["alice"], rel=1e-3)
    assert body["counts"] == {"queued": 4, "users": 2, "mine": 0}
    assert set(body["usage"]) == {"alice", "bob"}
    assert body["usage"]["bob"] == {
        "worker_hours": pytest.approx(queue["used"]["bob"], rel=1e-3),
        "share": 1.0, "max_workers": None, "max_queued": None,
    }  # fmt: skip
    assert body["unit"] == "CPU slot" and body["half_life_s"] == HALF_LIFE_S


def test_a_larger_share_puts_a_user_first(
    client: TestClient, admin: dict[str, str], queue: dict[str, Any]
) -> None:
    r = client.put("/v1/users/alice/quota", json={"share": 4, "max_workers": 2}, headers=admin)
    assert r.status_code == 200
    body = _get(client, admin)
    ids = queue["ids"]
    # alice: 1 h / 4 < bob: 0.5 h / 1
    assert [i["id"] for i in body["items"]] == [ids["a2"], ids["a1"], ids["b1"], ids["b2"]]
    assert body["items"][1]["usage"]["share"] == 4.0
    assert body["usage"]["alice"]["max_workers"] == 2 and body["usage"]["alice"]["share"] == 4.0


def test_a_user_sees_only_their_jobs_with_their_place_in_the_whole_queue(
    client: TestClient,
    bob: dict[str, str],
    admin: dict[str, str],
    factory: Factory,
    queue: dict[str, Any],
) -> None:
    client.put("/v1/users/bob/quota", json={"max_queued": 10}, headers=admin)
    factory.job("carol", pending_reason="waiting for 1 free worker")
    body = _get(client, bob)
    ids = queue["ids"]
    # carol, who used nothing, goes before bob though her job is the newest: a2, carol, b1, b2
    assert [(i["id"], i["position"]) for i in body["items"]] == [(ids["b1"], 3), (ids["b2"], 4)]
    assert {i["owner"] for i in body["items"]} == {"bob"}
    assert body["counts"] == {"queued": 5, "users": 3, "mine": 2}
    assert set(body["usage"]) == {"bob"}
    assert body["usage"]["bob"]["max_queued"] == 10


def test_a_user_with_nothing_queued_still_sees_their_usage(
    client: TestClient, factory: Factory, queue: dict[str, Any]
) -> None:
    used = _used(factory, "dave", 3, 2, workers=2)
    dave = {"Authorization": f"Bearer {factory.token('dave')}"}
    body = _get(client, dave)
    assert body["items"] == [] and body["counts"] == {"queued": 4, "users": 2, "mine": 0}
    assert list(body["usage"]) == ["dave"]
    assert body["usage"]["dave"]["worker_hours"] == pytest.approx(used, rel=1e-3)


def test_pending_reason_and_limit(
    client: TestClient, admin: dict[str, str], factory: Factory, queue: dict[str, Any]
) -> None:
    jid = factory.job("carol", spec=SPEC | {"priority": 9}, pending_reason="needs 4 workers")
    body = _get(client, admin, limit=2)
    assert [i["id"] for i in body["items"]] == [jid, queue["ids"]["a2"]]
    assert body["items"][0]["pending_reason"] == "needs 4 workers"
    assert body["counts"]["queued"] == 5  # the counts are of the whole queue
    for bad in (0, 1001, "x"):
        r = client.get("/v1/queue", headers=admin, params={"limit": bad})
        assert r.status_code == 422 and r.json()["error"]["details"][0]["field"] == "limit"


def test_an_empty_queue(client: TestClient, admin: dict[str, str]) -> None:
    body = _get(client, admin)
    assert body["items"] == [] and body["usage"] == {}
    assert body["counts"] == {"queued": 0, "users": 0, "mine": 0}


def test_no_token_is_401(client: TestClient) -> None:
    r = client.get("/v1/queue")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
