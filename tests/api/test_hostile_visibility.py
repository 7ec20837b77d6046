"""Hostile tenants, issue 25 ("tokens and what users see"): tokens can be listed and revoked
(a revoked token is refused at once, cache or not), and what one user sees of the pool
names none of another user's jobs, names or usage: /v1/workers, pending and attempt reasons,
the queue, and the pool-wide /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Attempt

pytestmark = pytest.mark.hostile


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- tokens -----------------------------------------------------------------------------


def test_tokens_are_listed_without_secrets_and_only_ones_own(
    client: TestClient, factory: Factory, admin: dict[str, str]
) -> None:
    alice, bob = factory.token("alice"), factory.token("bob")
    mine = client.get("/v1/tokens", headers=_auth(alice))
    assert mine.status_code == 200 and mine.headers["cache-control"] == "no-store"
    items = mine.json()["items"]
    assert [t["user"] for t in items] == ["alice"]
    assert alice not in mine.text and bob not in mine.text
    assert set(items[0]) == {"id", "user", "label", "prefix", "created_at"}
    assert alice.startswith(items[0]["prefix"]) and len(items[0]["prefix"]) < 12
    everyone = client.get("/v1/tokens", headers=admin).json()["items"]
    assert {"alice", "bob", "root"} <= {t["user"] for t in everyone}
    assert alice not in str(everyone) and bob not in str(everyone)


def test_only_admins_create_tokens_and_the_secret_is_shown_once(
    client: TestClient, factory: Factory, admin: dict[str, str]
) -> None:
    alice = _auth(factory.token("alice"))
    body = {"user": "eve", "label": "laptop", "admin": True}
    refused = client.post("/v1/tokens", json=body, headers=alice)
    assert refused.status_code == 403
    made = client.post("/v1/tokens", json={"user": "eve", "label": "laptop"}, headers=admin)
    assert made.status_code == 201, made.text
    secret = made.json()["token"]
    assert made.json()["user"] == "eve" and made.json()["label"] == "laptop"
    me = client.get("/v1/ui/session", headers=_auth(secret)).json()
    assert me["user"] == "eve" and not me["is_admin"]
    listed = client.get("/v1/tokens", headers=_auth(secret)).json()["items"]
    assert [t["label"] for t in listed] == ["laptop"] and secret not in str(listed)
    for bad in ({"user": ""}, {"user": "x" * 101}, {"user": "a\nb"}, {"user": "u", "x": 1}):
        r = client.post("/v1/tokens", json=bad, headers=admin)
        assert r.status_code == 422, bad


def test_a_revoked_token_is_refused_at_once_even_from_the_cache(
    client: TestClient, factory: Factory
) -> None:
    alice = _auth(factory.token("alice"))
    job = factory.job("alice")
    assert client.get(f"/v1/jobs/{job}", headers=alice).status_code == 200  # now cached
    token_id = client.get("/v1/tokens", headers=alice).json()["items"][0]["id"]
    assert client.delete(f"/v1/tokens/{token_id}", headers=alice).status_code == 204
    again = client.get(f"/v1/jobs/{job}", headers=alice)
    assert again.status_code == 401, "a revoked token was still accepted from the cache"


def test_a_revoked_tokens_dashboard_sessions_end_at_once(
    client: TestClient, factory: Factory, admin: dict[str, str]
) -> None:
    token = factory.token("alice")
    login = client.post("/v1/ui/sessions", json={}, headers=_auth(token))
    assert login.status_code == 201
    cookie = {"Cookie": f"ty_session={login.cookies['ty_session']}"}
    client.cookies.clear()
    assert client.get("/v1/ui/session", headers=cookie).status_code == 200  # cached
    tid = client.get("/v1/tokens", headers=_auth(token)).json()["items"][0]["id"]
    assert client.delete(f"/v1/tokens/{tid}", headers=admin).status_code == 204
    assert client.get("/v1/ui/session", headers=cookie).status_code == 401


def test_someone_elses_token_is_404_and_stays_live(client: TestClient, factory: Factory) -> None:
    alice, bob = factory.token("alice"), factory.token("bob")
    bob_id = client.get("/v1/tokens", headers=_auth(bob)).json()["items"][0]["id"]
    for tid in (bob_id, 999_999):
        r = client.delete(f"/v1/tokens/{tid}", headers=_auth(alice))
        assert r.status_code == 404 and r.json()["error"]["message"] == "token not found"
    assert client.get("/v1/tokens", headers=_auth(bob)).status_code == 200
    assert client.delete("/v1/tokens/abc", headers=_auth(alice)).status_code == 422


# --- what a user sees of others ---------------------------------------------------------


def test_workers_show_only_ones_own_job_ids(
    client: TestClient, factory: Factory, admin: dict[str, str]
) -> None:
    alice = _auth(factory.token("alice"))
    mine, theirs = factory.job("alice", state="running"), factory.job("bob", state="running")
    factory.worker("w-a", state="busy", current_job_id=mine)
    factory.worker("w-b", state="busy", current_job_id=theirs)
    seen = {w["id"]: w for w in client.get("/v1/workers", headers=alice).json()["items"]}
    assert seen["w-a"]["current_job_id"] == mine
    assert seen["w-b"]["current_job_id"] is None and seen["w-b"]["state"] == "busy"
    assert theirs not in client.get("/v1/workers", headers=alice).text
    full = {w["id"]: w for w in client.get("/v1/workers", headers=admin).json()["items"]}
    assert full["w-b"]["current_job_id"] == theirs


def test_pending_and_attempt_reasons_name_no_other_users_jobs_or_usage(
    client: TestClient, factory: Factory, admin: dict[str, str], db_url: str
) -> None:
    alice = _auth(factory.token("alice"))
    victim, other = factory.job("bob", state="running"), factory.job("carol", state="running")
    waiting = factory.job("alice")
    factory.set_pending(
        waiting,
        "fair share: alice has used 3.0 GPU-h, bob 0.4 (half-life 1 day); "
        f"preempting 2 jobs for 1 worker: {victim} (priority 0), {other} (priority 0) "
        "(reserving workers)",
    )
    soon = factory.job("alice")
    factory.set_pending(  # scheduler/preemption.py: will_preempt
        soon,
        f"no idle worker; will preempt 1 job: {victim} (priority 0) at 12:00:30 UTC, in 20s "
        "(TORCHYARD_PREEMPT_AFTER_S) unless a worker frees up first",
    )
    said = client.get(f"/v1/jobs/{soon}", headers=alice).json()["pending_reason"]
    assert victim not in said and "will preempt 1 job: another job (priority 0) at" in said
    preempted = factory.job("alice", state="running")
    a = factory.attempt(preempted)
    with session_scope(db_url) as s:
        row = s.get(Attempt, a)
        assert row is not None
        row.reason = f"lost while preempted by job {victim}"
    body = client.get(f"/v1/jobs/{waiting}", headers=alice).json()
    reason = body["pending_reason"]
    assert victim not in reason and other not in reason and "bob" not in reason
    assert "0.4" not in reason and "alice has used 3.0 GPU-h" in reason
    assert "another job (priority 0)" in reason
    shown = client.get(f"/v1/jobs/{preempted}", headers=alice).text
    assert victim not in shown and "preempted by another job" in shown
    listed = client.get("/v1/jobs", headers=alice).text
    queue = client.get("/v1/queue", headers=alice).text
    table = client.get("/v1/ui/jobs", headers=alice).text  # the dashboard's jobs table
    assert "another job (priority 0)" in table
    for text in (listed, queue, table):
        assert victim not in text and other not in text and "bob" not in text
    assert victim in client.get("/v1/queue", headers=admin).text  # admins see it all


def test_metrics_are_for_admins_or_the_scrape_token(
    settings: Settings, factory: Factory, admin: dict[str, str]
) -> None:
    from torchyard.api.app import create_app

    alice = _auth(factory.token("alice"))
    scrape = "s" * 32
    app = create_app(settings.model_copy(update={"metrics_token": scrape}))
    with TestClient(app) as c:
        r = c.get("/metrics", headers=alice)
        assert r.status_code == 403 and "torchyard_jobs" not in r.text
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=_auth("s" * 31 + "t")).status_code == 401
        assert c.get("/metrics", headers=_auth(scrape)).status_code == 200
        assert "torchyard_jobs" in c.get("/metrics", headers=admin).text
