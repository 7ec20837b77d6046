"""Webhooks over REST (api/routers/webhooks.py), on SQLite and PostgreSQL: create, list,
delete, deliveries; the checks (422 naming the field); who may (another user's webhook is
a 404, a project member who is not its owner gets 403); the secret answered once, never
listed; the audit entries."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support.db import Factory

from torchyard.store.db import session_scope
from torchyard.store.models import AuditEntry, WebhookDelivery
from torchyard.store.states import FAILED, RUNNING

SECRET = "0123456789abcdef-secret"


def _create(client: TestClient, headers: dict[str, str], **body: object) -> dict:
    r = client.post(
        "/v1/webhooks",
        json={"url": "http://hooks.example:9/hook", "events": ["job.failed"], **body},
        headers=headers,
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_create_list_delete_and_the_secret_once(
    client: TestClient, alice: dict[str, str], db_url: str
) -> None:
    made = _create(client, alice, secret=SECRET, events=["job.failed", "sweep.completed"])
    assert made["secret"] == SECRET and made["owner"] == "alice" and made["project"] is None
    assert made["events"] == ["job.failed", "sweep.completed"] and made["active"] is True
    generated = _create(client, alice)
    assert len(generated["secret"]) >= 32  # made for us, answered this once
    r = client.get("/v1/webhooks", headers=alice)
    assert r.status_code == 200
    assert [h["id"] for h in r.json()["items"]] == [made["id"], generated["id"]]
    assert SECRET not in r.text and generated["secret"] not in r.text
    assert r.json()["items"][0]["secret"] == "…" + SECRET[-4:]
    assert client.delete(f"/v1/webhooks/{made['id']}", headers=alice).status_code == 204
    assert [h["id"] for h in client.get("/v1/webhooks", headers=alice).json()["items"]] == [
        generated["id"]
    ]
    assert client.delete(f"/v1/webhooks/{made['id']}", headers=alice).status_code == 404
    with session_scope(db_url) as s:
        actions = [
            (a.action, a.target) for a in s.scalars(select(AuditEntry).order_by(AuditEntry.id))
        ]
        details = s.scalars(select(AuditEntry.details)).first()
    assert ("webhook.create", f"webhook:{made['id']}") in actions
    assert ("webhook.delete", f"webhook:{made['id']}") in actions
    assert details is not None and SECRET not in str(details)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"url": "ftp://example.com/x"}, "url", "http"),
        ({"url": "http://169.254.169.254/latest/meta-data"}, "url", "denied"),
        ({"url": "http://[fe80::1]/x"}, "url", "denied"),
        ({"url": "http://[::ffff:169.254.169.254]/x"}, "url", "denied"),
        ({"url": "http:///nohost"}, "url", "host"),
        ({"url": "http://example.com/" + "a" * 2000}, "body.url", "2000"),
        ({"events": []}, "body.events", "at least 1"),
        ({"events": ["job.failed", "job.exploded"]}, "events", "'job.exploded'"),
        ({"secret": "short"}, "body.secret", "16"),
        ({"secret": "x" * 257}, "body.secret", "256"),
        ({"secret": "has spaces in it, sixteen+"}, "secret", "printable"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(
    client: TestClient, alice: dict[str, str], body: dict, field: str, words: str
) -> None:
    full = {"url": "http://hooks.example:9/h", "events": ["job.failed"], **body}
    r = client.post("/v1/webhooks", json=full, headers=alice)
    assert r.status_code == 422, r.text
    fields = {d["field"]: d["message"] for d in r.json()["error"]["details"]}
    assert field in fields and words in fields[field], fields


def test_another_users_webhook_is_404_and_admins_see_all(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], admin: dict[str, str]
) -> None:
    hook = _create(client, alice)["id"]
    assert client.get("/v1/webhooks", headers=bob).json()["items"] == []
    assert client.delete(f"/v1/webhooks/{hook}", headers=bob).status_code == 404
    assert client.get(f"/v1/webhooks/{hook}/deliveries", headers=bob).status_code == 404
    assert [h["id"] for h in client.get("/v1/webhooks", headers=admin).json()["items"]] == [hook]
    assert client.get(f"/v1/webhooks/{hook}/deliveries", headers=admin).status_code == 200
    assert client.get("/v1/webhooks").status_code == 401


def test_project_webhooks_are_for_its_owners(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], factory: Factory
) -> None:
    carol = {"Authorization": f"Bearer {factory.token('carol')}"}
    assert client.post("/v1/projects", json={"name": "lab"}, headers=alice).status_code == 201
    r = client.put("/v1/projects/lab/members/bob", json={"role": "member"}, headers=alice)
    assert r.status_code == 200
    r = client.post("/v1/webhooks", json={"url": "http://hooks.example:9/h",
                    "events": ["job.failed"], "project": "lab"}, headers=bob)  # fmt: skip
    assert r.status_code == 403 and "owner" in r.json()["error"]["message"]
    r = client.post("/v1/webhooks", json={"url": "http://hooks.example:9/h",
                    "events": ["job.failed"], "project": "lab"}, headers=carol)  # fmt: skip
    assert r.status_code == 404  # no role: the project does not exist for carol
    hook = _create(client, alice, project="lab")
    assert hook["project"] == "lab"
    assert client.get("/v1/webhooks", headers=bob).json()["items"] == []
    # bob made owner: he manages the project's webhooks now
    client.put("/v1/projects/lab/members/bob", json={"role": "owner"}, headers=alice)
    assert [h["id"] for h in client.get("/v1/webhooks", headers=bob).json()["items"]] == [
        hook["id"]
    ]


def test_deliveries_show_each_delivery_with_its_attempts(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str
) -> None:
    from torchyard.store.models import utcnow
    from torchyard.store.webhooks import Outcome, claim_due, record_attempt

    hook = _create(client, alice, events=["job.failed"])["id"]
    jobs = [factory.job("alice", RUNNING) for _ in range(3)]
    for j in jobs:
        factory.set_state(j, FAILED, error="bad")
    with session_scope(db_url) as s:
        due = claim_due(s, "t", 60, 10)
    with session_scope(db_url) as s:
        record_attempt(s, due[0], "t", Outcome(utcnow(), 12, 500, "HTTP 500"), 10)
    r = client.get(f"/v1/webhooks/{hook}/deliveries", params={"limit": 2}, headers=alice)
    assert r.status_code == 200, r.text
    page = r.json()
    assert [d["subject"] for d in page["items"]] == [jobs[2], jobs[1]]  # newest first
    assert page["next_cursor"]
    r = client.get(f"/v1/webhooks/{hook}/deliveries",
                   params={"cursor": page["next_cursor"]}, headers=alice)  # fmt: skip
    (first,) = r.json()["items"]
    assert first["subject"] == jobs[0] and first["state"] == "pending"
    assert first["event"] == "job.failed" and first["payload"]["job"]["error"] == "bad"
    assert [(a["status_code"], a["error"]) for a in first["attempts"]] == [(500, "HTTP 500")]
    assert first["last_status_code"] == 500 and first["next_attempt_at"]
    with session_scope(db_url) as s:
        assert s.scalar(select(WebhookDelivery.id).where(WebhookDelivery.id == first["id"]))
    assert client.delete(f"/v1/webhooks/{hook}", headers=alice).status_code == 204
    with session_scope(db_url) as s:  # its deliveries went with it
        assert s.scalars(select(WebhookDelivery)).all() == []
