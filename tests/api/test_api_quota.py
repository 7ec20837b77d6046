"""Quotas through HTTP on each database backend: PUT/GET /v1/users/{name}/quota (admins set,
a user reads their own) and the 429 a submit over max_queued gets."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC, Factory

from torchyard.store.db import session_scope
from torchyard.store.models import Job
from torchyard.store.states import STARTING

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

QUOTA = "/v1/users/{}/quota"
UNLIMITED = {"max_workers": None, "max_queued": None, "share": 1.0, "max_priority": 0}


def _error(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    return body["error"]


def _stored_jobs(db_url: str) -> int:
    with session_scope(db_url) as s:
        return s.query(Job).count()


def test_put_then_get_the_whole_quota(
    client: TestClient, admin: dict[str, str], alice: dict[str, str]
) -> None:
    assert client.get(QUOTA.format("alice"), headers=admin).json() == {"user": "alice"} | UNLIMITED
    body = {"max_workers": 4, "max_queued": 20, "share": 2, "max_priority": 10}
    r = client.put(QUOTA.format("alice"), json=body, headers=admin)
    assert r.status_code == 200, r.text
    want = {"user": "alice", "max_workers": 4, "max_queued": 20, "share": 2.0, "max_priority": 10}
    assert r.json() == want
    assert client.get(QUOTA.format("alice"), headers=admin).json() == want
    # a user reads their own, by name or as `me`
    assert client.get(QUOTA.format("alice"), headers=alice).json() == want
    assert client.get(QUOTA.format("me"), headers=alice).json() == want


def test_fields_not_given_are_kept_and_null_removes_a_limit(
    client: TestClient, admin: dict[str, str], alice: dict[str, str]
) -> None:
    url = QUOTA.format("alice")
    client.put(url, json={"max_workers": 4, "max_queued": 20, "share": 2}, headers=admin)
    r = client.put(url, json={"max_queued": 0}, headers=admin)  # 0: nothing may be queued
    want = {"user": "alice", "max_workers": 4, "max_queued": 0, "share": 2.0, "max_priority": 0}
    assert r.json() == want
    client.put(url, json={"max_priority": -5}, headers=admin)
    r = client.put(url, json={"max_workers": None, "share": None, "max_priority": None},
                   headers=admin)  # fmt: skip
    assert r.json() == want | {"max_workers": None, "share": 1.0}  # null: back to 0
    assert client.put(url, json={}, headers=admin).json() == r.json()
    assert client.get(url, headers=alice).json() == r.json()


def test_an_admin_sets_their_own_quota_as_me(client: TestClient, admin: dict[str, str]) -> None:
    r = client.put(QUOTA.format("me"), json={"share": 0.5}, headers=admin)
    assert r.status_code == 200 and r.json() == {"user": "root"} | UNLIMITED | {"share": 0.5}


BAD = [
    ({"max_workers": -1}, "max_workers"),
    ({"max_workers": 1.5}, "max_workers"),
    ({"max_workers": "3"}, "max_workers"),
    ({"max_queued": True}, "max_queued"),
    ({"max_queued": 10**7}, "max_queued"),
    ({"share": 0}, "share"),
    ({"share": -2}, "share"),
    ({"share": "2"}, "share"),
    ({"max_gpus": 4}, "max_gpus"),
    ({"max_priority": 1001}, "max_priority"),
    ({"max_priority": -1001}, "max_priority"),
    ({"max_priority": 1.5}, "max_priority"),
    ({"max_priority": "5"}, "max_priority"),
    ({"max_priority": True}, "max_priority"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[str(b) for b, _ in BAD])
def test_bad_values_and_unknown_fields_are_422_and_change_nothing(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], body: dict, field: str
) -> None:
    url = QUOTA.format("alice")
    client.put(url, json={"max_workers": 4}, headers=admin)
    r = client.put(url, json={"max_queued": 3} | body, headers=admin)
    err = _error(r, 422, "validation_error")
    assert [d["field"] for d in err["details"]] == [f"body.{field}"]
    assert client.get(url, headers=admin).json() == {"user": "alice"} | UNLIMITED | {
        "max_workers": 4
    }


@pytest.mark.parametrize("raw", [b'{"share": NaN}', b'{"share": Infinity}', b"[1]", b"4", b"{"])
def test_non_finite_share_and_non_objects_are_422(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], raw: bytes
) -> None:
    headers = admin | {"content-type": "application/json"}
    _error(client.put(QUOTA.format("alice"), content=raw, headers=headers), 422, "validation_error")


def test_only_admins_set_quotas_and_see_others(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], bob: dict[str, str]
) -> None:
    for url in (QUOTA.format("alice"), QUOTA.format("me"), QUOTA.format("bob")):
        err = _error(client.put(url, json={"max_workers": 9}, headers=alice), 403, "forbidden")
        assert "admin" in err["message"]
    # refused before the body is read: a bad body is still 403, not 422
    _error(client.put(QUOTA.format("alice"), json={"x": 1}, headers=alice), 403, "forbidden")
    _error(client.get(QUOTA.format("bob"), headers=alice), 403, "forbidden")
    # and an unknown name is no different to a non-admin (names are not probed)
    _error(client.get(QUOTA.format("nobody"), headers=alice), 403, "forbidden")
    assert client.get(QUOTA.format("me"), headers=bob).json() == {"user": "bob"} | UNLIMITED


def test_unknown_user_is_404(client: TestClient, admin: dict[str, str]) -> None:
    err = _error(client.get(QUOTA.format("nobody"), headers=admin), 404, "not_found")
    assert "nobody" in err["message"]
    _error(client.put(QUOTA.format("nobody"), json={"share": 2}, headers=admin), 404, "not_found")


def test_no_token_is_401(client: TestClient, alice: dict[str, str]) -> None:
    _error(client.get(QUOTA.format("alice")), 401, "unauthorized")
    _error(client.put(QUOTA.format("alice"), json={"share": 2}), 401, "unauthorized")


# -- 429 over max_queued --------------------------------------------------------------------------


def test_submit_over_max_queued_is_429_and_stores_nothing(
    client: TestClient,
    admin: dict[str, str],
    alice: dict[str, str],
    bob: dict[str, str],
    factory: Factory,
    db_url: str,
) -> None:
    client.put(QUOTA.format("alice"), json={"max_queued": 2}, headers=admin)
    first = client.post("/v1/jobs", json=SPEC, headers=alice).json()["id"]
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201
    err = _error(client.post("/v1/jobs", json=SPEC, headers=alice), 429, "quota_exceeded")
    assert "max_queued is 2" in err["message"] and "alice already has 2 queued" in err["message"]
    assert err["details"] == [{"field": "max_queued", "limit": 2}]
    assert _stored_jobs(db_url) == 2
    # other users are not limited by alice's quota
    assert client.post("/v1/jobs", json=SPEC, headers=bob).status_code == 201
    # only queued jobs count: once one starts, there is room again
    factory.set_state(first, STARTING)
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201
    _error(client.post("/v1/jobs", json=SPEC, headers=alice), 429, "quota_exceeded")


def test_max_queued_0_refuses_every_submit(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], db_url: str
) -> None:
    client.put(QUOTA.format("alice"), json={"max_queued": 0}, headers=admin)
    _error(client.post("/v1/jobs", json=SPEC, headers=alice), 429, "quota_exceeded")
    assert _stored_jobs(db_url) == 0
    client.put(QUOTA.format("alice"), json={"max_queued": None}, headers=admin)
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201


def test_an_idempotent_retry_is_answered_even_at_the_limit(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], db_url: str
) -> None:
    key = {"Idempotency-Key": "k-1"}
    first = client.post("/v1/jobs", json=SPEC, headers=alice | key)
    assert first.status_code == 201
    client.put(QUOTA.format("alice"), json={"max_queued": 1}, headers=admin)
    retry = client.post("/v1/jobs", json=SPEC, headers=alice | key)
    assert retry.status_code == 200 and retry.json()["id"] == first.json()["id"]
    # the same key with another spec is still the conflict it always was
    _error(client.post("/v1/jobs", json=SPEC | {"epochs": 2}, headers=alice | key), 409,
           "idempotency_conflict")  # fmt: skip
    # a new key is a new job: refused
    other = {"Idempotency-Key": "k-2"}
    _error(client.post("/v1/jobs", json=SPEC, headers=alice | other), 429, "quota_exceeded")
    assert _stored_jobs(db_url) == 1


def test_concurrent_submits_never_pass_max_queued(
    client: TestClient, admin: dict[str, str], alice: dict[str, str], db_url: str
) -> None:
    client.put(QUOTA.format("alice"), json={"max_queued": 3}, headers=admin)
    statuses: list[int] = []
    start = threading.Barrier(8)

    def submit() -> None:
        start.wait()
        statuses.append(client.post("/v1/jobs", json=SPEC, headers=alice).status_code)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(statuses) == [201] * 3 + [429] * 5
    assert _stored_jobs(db_url) == 3
