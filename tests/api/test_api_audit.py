"""The audit trail on both databases: one entry per change a person makes (submit, cancel,
token create and revoke, quota, sweep create and cancel, login and logout, bundle upload,
the local `token create`), none for a refused request or a change that changed nothing,
the entry committed with its change or not at all, entries that no UPDATE or DELETE can
touch, who reads what through `GET /v1/audit` (admins all, a project's owners its
entries), its filters and cursor, and `torchyard audit`."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from support.db import SPEC, Factory

from torchyard.client import cmd_audit
from torchyard.client.cli import main
from torchyard.client.sdk import Client
from torchyard.store.auth import get_or_create_user
from torchyard.store.db import session_scope
from torchyard.store.models import AuditEntry, Job, Sweep
from torchyard.store.projects import create_project, project_named, set_member

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

Headers = dict[str, str]
ENTRY_KEYS = {"id", "time", "user", "action", "target", "details", "client"}
SWEEP: dict[str, Any] = {
    "name": "lr-search",
    "spec": SPEC,
    "space": {"optimizer.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True}},
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 4,
    "parallel": 2,
}


def stored(db_url: str) -> list[AuditEntry]:
    """Every entry in the table, oldest first, read straight from the database."""
    with session_scope(db_url) as s:
        rows = list(s.scalars(select(AuditEntry).order_by(AuditEntry.id)))
        s.expunge_all()
        return rows


def actions(db_url: str) -> list[tuple[str, str, str]]:
    return [(e.user_name, e.action, e.target) for e in stored(db_url)]


def listed(client: TestClient, headers: Headers, **params: Any) -> list[dict[str, Any]]:
    r = client.get("/v1/audit", headers=headers, params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"items", "next_cursor"}
    for e in body["items"]:
        assert set(e) == ENTRY_KEYS
    return list(body["items"])


def project_of(db_url: str, job_id: str) -> int | None:
    with session_scope(db_url) as s:
        return s.scalar(select(Job.project_id).where(Job.id == job_id))


# -- one entry per change ---------------------------------------------------------------------


def test_submit_and_cancel_are_recorded_once(
    client: TestClient, alice: Headers, db_url: str
) -> None:
    r = client.post(
        "/v1/jobs", json=SPEC | {"name": "tiny"}, headers=alice | {"Idempotency-Key": "k1"}
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    replay = client.post(
        "/v1/jobs", json=SPEC | {"name": "tiny"}, headers=alice | {"Idempotency-Key": "k1"}
    )
    assert replay.status_code == 200  # the same job again: nothing stored, nothing recorded
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=alice).status_code == 202
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=alice).status_code == 202  # no-op
    target = f"job:{job_id}"
    assert actions(db_url) == [("alice", "job.submit", target), ("alice", "job.cancel", target)]
    submit, cancel = stored(db_url)
    project = project_of(db_url, job_id)
    assert submit.project_id == cancel.project_id == project
    assert submit.details == {"name": "tiny", "project_id": project}
    assert cancel.details == {"name": "tiny", "project_id": project, "state": "queued"}
    assert submit.client == "testclient" and submit.user_id is not None
    assert submit.time <= cancel.time and submit.id < cancel.id


def test_the_client_address_is_the_peer_or_what_a_trusted_proxy_forwarded(
    app: FastAPI, alice: Headers, db_url: str
) -> None:
    forged = {"X-Forwarded-For": "203.0.113.9"}
    with TestClient(app, client=("10.1.2.3", 5000)) as direct:  # not a trusted proxy
        assert direct.post("/v1/jobs", json=SPEC, headers=alice | forged).status_code == 201
    app.state.settings = app.state.settings.model_copy(update={"trusted_proxies": "10.1.0.0/16"})
    with TestClient(app, client=("10.1.2.3", 5000)) as proxied:
        hops = {"X-Forwarded-For": "198.51.100.1, 192.0.2.7"}  # the proxy appended the last
        assert proxied.post("/v1/jobs", json=SPEC, headers=alice | hops).status_code == 201
    assert [e.client for e in stored(db_url)] == ["10.1.2.3", "192.0.2.7"]


def test_token_create_and_revoke_never_record_the_secret(
    client: TestClient, admin: Headers, db_url: str
) -> None:
    body = {"user": "carol", "label": "laptop", "can_run_code": True}
    made = client.post("/v1/tokens", json=body, headers=admin).json()
    again = client.post("/v1/tokens", json={"user": "carol", "admin": True}, headers=admin).json()
    for token_id in (made["id"], made["id"]):  # the second revoke changes nothing
        assert client.delete(f"/v1/tokens/{token_id}", headers=admin).status_code == 204
    assert actions(db_url) == [
        ("root", "token.create", f"token:{made['id']}"),
        ("root", "user.create", "user:carol"),
        ("root", "token.create", f"token:{again['id']}"),
        ("root", "user.grant", "user:carol"),
        ("root", "token.revoke", f"token:{made['id']}"),
    ]
    entries = stored(db_url)
    assert entries[0].details == {"user": "carol", "admin": False, "can_run_code": True, "label": "laptop"}  # fmt: skip
    assert entries[1].details == {"admin": False, "can_run_code": True}
    assert entries[3].details == {"before": {"admin": False}, "after": {"admin": True}}
    assert entries[4].details == {"user": "carol", "label": "laptop"}
    dumped = json.dumps([e.details for e in entries])
    assert made["token"] not in dumped and made["token"][:10] not in dumped
    assert all(e.project_id is None for e in entries)  # admins' reading only


def test_quota_change_records_before_and_after(
    client: TestClient, admin: Headers, alice: Headers, db_url: str
) -> None:
    quota = "/v1/users/alice/quota"
    assert client.put(quota, json={"max_queued": 5, "share": 2}, headers=admin).status_code == 200
    assert client.put(quota, json={"max_queued": 5}, headers=admin).status_code == 200  # same
    assert client.put(quota, json={"max_priority": 10}, headers=admin).status_code == 200
    assert actions(db_url) == [("root", "user.quota", "user:alice")] * 2
    first, second = stored(db_url)
    assert first.details == {
        "before": {"max_queued": None, "share": 1.0},
        "after": {"max_queued": 5, "share": 2.0},
    }
    assert second.details == {"before": {"max_priority": 0}, "after": {"max_priority": 10}}


def test_sweep_create_and_cancel(client: TestClient, alice: Headers, db_url: str) -> None:
    r = client.post("/v1/sweeps", json=SWEEP, headers=alice)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    for _ in range(2):  # the second cancel finds it ended: nothing recorded
        assert client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=alice).status_code == 202
    target = f"sweep:{sweep_id}"
    assert actions(db_url) == [("alice", "sweep.create", target), ("alice", "sweep.cancel", target)]
    with session_scope(db_url) as s:
        project = s.scalar(select(Sweep.project_id).where(Sweep.id == sweep_id))
    created, cancelled = stored(db_url)
    assert created.project_id == cancelled.project_id == project
    assert created.details == {"name": "lr-search", "project_id": project, "trials": 4}


def test_login_and_logout(client: TestClient, alice: Headers, bob: Headers, db_url: str) -> None:
    secret = client.post("/v1/ui/login-links", headers=alice).json()["secret"]
    assert client.post("/v1/ui/sessions", json={"login": secret}).status_code == 201
    csrf = client.get("/v1/ui/session").json()["csrf"]
    assert client.delete("/v1/ui/session", headers={"X-CSRF-Token": csrf}).status_code == 204
    # A token login, and a refused one (a used link), which records nothing.
    assert client.post("/v1/ui/sessions", json={}, headers=bob).status_code == 201
    client.cookies.clear()
    assert client.post("/v1/ui/sessions", json={"login": secret}).status_code == 401
    assert actions(db_url) == [
        ("alice", "auth.login", "user:alice"),
        ("alice", "auth.logout", "user:alice"),
        ("bob", "auth.login", "user:bob"),
    ]
    entries = stored(db_url)
    assert entries[0].details["via"] == "login link" and entries[2].details["via"] == "token"
    assert all(e.client == "testclient" and e.user_id is not None for e in entries)


def test_bundle_upload_is_recorded_once(
    client: TestClient, db_url: str, tmp_path: Path, factory: Factory
) -> None:
    from torchyard.client.bundle import pack
    from torchyard.store.auth import create_token

    with session_scope(db_url) as s:
        coder = {"Authorization": f"Bearer {create_token(s, 'carol', can_run_code=True)}"}
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    data = pack(tmp_path / "code")
    gz = {"Content-Type": "application/gzip"}
    first = client.post("/v1/bundles", content=data, headers=coder | gz)
    assert first.status_code == 201, first.text
    assert client.post("/v1/bundles", content=data, headers=coder | gz).status_code == 200
    assert actions(db_url) == [("carol", "bundle.upload", f"bundle:{first.json()['id']}")]


def test_local_token_create_is_recorded_as_the_os_user(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchyard.settings import get_settings
    from torchyard.store import cli

    monkeypatch.setenv("TORCHYARD_DATABASE_URL", db_url)
    monkeypatch.setattr(cli.getpass, "getuser", lambda: "ops")
    get_settings.cache_clear()
    try:
        assert cli.token_main(["create", "--user", "dora", "--admin"]) == 0
    finally:
        get_settings.cache_clear()
    token = capsys.readouterr().out.strip()
    [entry] = stored(db_url)
    assert (entry.user_name, entry.user_id, entry.client) == ("ops@local", None, "local")
    assert entry.action == "token.create" and entry.target.startswith("token:")
    assert entry.details == {"user": "dora", "admin": True, "can_run_code": False, "label": None}
    assert token not in json.dumps(entry.details)


# -- refused requests and failed commits leave nothing ----------------------------------------


def test_refused_requests_record_nothing(
    client: TestClient, alice: Headers, bob: Headers, admin: Headers, db_url: str
) -> None:
    bad = copy.deepcopy(SPEC)
    bad["optimizer"]["lr"] = -1
    assert client.post("/v1/jobs", json=bad, headers=alice).status_code == 422
    assert client.post("/v1/jobs", json=SPEC | {"priority": 5}, headers=alice).status_code == 403
    assert client.put("/v1/users/bob/quota", json={"share": 9}, headers=alice).status_code == 403
    assert client.post("/v1/tokens", json={"user": "eve"}, headers=alice).status_code == 403
    assert client.post("/v1/sweeps", json=SWEEP | {"trials": 0}, headers=alice).status_code == 422
    theirs = client.post("/v1/jobs", json=SPEC, headers=bob).json()["id"]
    assert client.post(f"/v1/jobs/{theirs}/cancel", headers=alice).status_code == 404
    assert client.delete("/v1/tokens/999", headers=alice).status_code == 404
    before = actions(db_url)
    assert before == [("bob", "job.submit", f"job:{theirs}")]
    r = client.put("/v1/users/alice/quota", json={"max_queued": 0}, headers=admin)
    assert r.status_code == 200
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 429
    assert actions(db_url) == [*before, ("root", "user.quota", "user:alice")]


@contextmanager
def failing_commits(app: FastAPI) -> Iterator[None]:
    """Every commit of the app's write sessions fails, after the route's changes (and its
    entry) were flushed: what a database that goes away at the commit does."""

    def fail(session: Session) -> None:
        session.flush()  # the change and the entry reach the database, uncommitted
        raise RuntimeError("the commit failed")

    target = app.state.sessions
    event.listen(target, "before_commit", fail)
    try:
        yield
    finally:
        event.remove(target, "before_commit", fail)


def test_a_failed_commit_leaves_neither_the_change_nor_its_entry(
    app: FastAPI, alice: Headers, admin: Headers, factory: Factory, db_url: str
) -> None:
    job_id = factory.job("alice")
    with TestClient(app, raise_server_exceptions=False) as client, failing_commits(app):
        assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 500
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=alice).status_code == 500
        r = client.put("/v1/users/alice/quota", json={"share": 3}, headers=admin)
        assert r.status_code == 500
        assert client.post("/v1/tokens", json={"user": "eve"}, headers=admin).status_code == 500
    assert stored(db_url) == []
    with session_scope(db_url) as s:
        assert list(s.scalars(select(Job.id))) == [job_id]  # no new job
        assert s.scalar(select(Job.state).where(Job.id == job_id)) == "queued"
        assert s.scalar(text("SELECT share FROM users WHERE name = 'alice'")) == 1.0
        assert s.scalar(text("SELECT count(*) FROM users WHERE name = 'eve'")) == 0


# -- append-only ------------------------------------------------------------------------------


def test_entries_cannot_be_updated_or_deleted(
    client: TestClient, alice: Headers, db_url: str
) -> None:
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201
    statements = [
        "UPDATE audit_log SET user_name = 'mallory'",
        "UPDATE audit_log SET details = '{}' WHERE id > 0",
        "DELETE FROM audit_log",
    ]
    if db_url.startswith("postgresql"):
        statements.append("TRUNCATE audit_log")
    for statement in statements:
        with pytest.raises(DBAPIError, match="append-only"), session_scope(db_url) as s:
            s.execute(text(statement))
    assert actions(db_url) == [("alice", "job.submit", stored(db_url)[0].target)]


# -- who reads what ---------------------------------------------------------------------------


def _team(db_url: str) -> None:
    """Project `vision`, owned by alice, with bob as a member; dora is nobody's owner."""
    with session_scope(db_url) as s:
        alice = get_or_create_user(s, "alice")
        bob = get_or_create_user(s, "bob")
        project = create_project(s, "vision", alice.id)
        set_member(s, project, bob, "member")
        get_or_create_user(s, "dora")


def _record_in(db_url: str, project: str, action: str) -> None:
    """An entry of `project`, as a project route would write it."""
    from torchyard.store.audit import Actor, record

    with session_scope(db_url) as s:
        found = project_named(s, project)
        assert found is not None
        record(s, Actor(None, "bob"), action, f"project:{project}", project_id=found.id)


def test_admins_read_all_owners_their_projects_and_others_nothing(
    client: TestClient, alice: Headers, bob: Headers, admin: Headers, factory: Factory, db_url: str
) -> None:
    dora = {"Authorization": f"Bearer {factory.token('dora')}"}
    _team(db_url)
    mine = client.post("/v1/jobs", json=SPEC, headers=alice).json()["id"]
    theirs = client.post("/v1/jobs", json=SPEC, headers=bob).json()["id"]
    client.put("/v1/users/dora/quota", json={"share": 2}, headers=admin)
    _record_in(db_url, "vision", "project.member")
    every = listed(client, admin)
    assert [(e["action"], e["target"]) for e in every] == [
        ("project.member", "project:vision"),
        ("user.quota", "user:dora"),
        ("job.submit", f"job:{theirs}"),
        ("job.submit", f"job:{mine}"),
    ]
    # alice owns ~alice and vision; bob owns ~bob (in vision a member only); dora nothing of
    # these (her quota's entry is the admins').
    assert [e["target"] for e in listed(client, alice)] == ["project:vision", f"job:{mine}"]
    assert [e["target"] for e in listed(client, bob)] == [f"job:{theirs}"]
    assert listed(client, dora) == []
    assert [e["target"] for e in listed(client, alice, project="vision")] == ["project:vision"]
    assert [e["target"] for e in listed(client, admin, project="~bob")] == [f"job:{theirs}"]
    assert client.get("/v1/audit", params={"project": "vision"}, headers=bob).status_code == 403
    assert client.get("/v1/audit", params={"project": "~bob"}, headers=alice).status_code == 404
    assert client.get("/v1/audit", params={"project": "nope"}, headers=admin).status_code == 404
    assert client.get("/v1/audit").status_code == 401


def test_filters_and_cursor(client: TestClient, alice: Headers, admin: Headers) -> None:
    ids = [client.post("/v1/jobs", json=SPEC, headers=alice).json()["id"] for _ in range(3)]
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=alice)
    client.put("/v1/users/alice/quota", json={"share": 2}, headers=admin)
    every = listed(client, admin)
    assert len(every) == 5 and [e["id"] for e in every] == sorted((e["id"] for e in every), reverse=True)  # fmt: skip
    assert [e["action"] for e in listed(client, admin, user="root")] == ["user.quota"]
    assert len(listed(client, admin, action="job.")) == 4  # a prefix
    assert len(listed(client, admin, action="job")) == 0  # exact
    assert len(listed(client, admin, action="job.submit")) == 3
    by_target = listed(client, admin, target=f"job:{ids[0]}")
    assert [e["action"] for e in by_target] == ["job.cancel", "job.submit"]
    cut = every[2]["time"]  # the third newest: since is inclusive, until exclusive
    assert {e["id"] for e in listed(client, admin, since=cut)} >= {e["id"] for e in every[:3]}
    assert all(e["time"] < cut for e in listed(client, admin, until=cut))
    assert listed(client, admin, since="2999-01-01T00:00:00") == []
    # Pages of two follow each other exactly, newest first.
    seen: list[int] = []
    cursor = None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        body = client.get("/v1/audit", params=params, headers=admin).json()
        seen += [e["id"] for e in body["items"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == [e["id"] for e in every]
    for bad in ({"cursor": "nonsense"}, {"limit": 0}, {"limit": 501}, {"since": "yesterday"}):
        assert client.get("/v1/audit", params=bad, headers=admin).status_code == 422


# -- the command ------------------------------------------------------------------------------


def test_torchyard_audit_command(
    client: TestClient,
    alice: Headers,
    admin: Headers,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [client.post("/v1/jobs", json=SPEC, headers=alice).json()["id"] for _ in range(3)]
    client.put("/v1/users/alice/quota", json={"share": 2}, headers=admin)
    token = admin["Authorization"].removeprefix("Bearer ")
    monkeypatch.setattr(cmd_audit, "PAGE", 2)  # so that --limit 3 follows a cursor
    assert (
        main(["audit", "--action", "job.", "-n", "3", "--json", "--token", token], http=client) == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert [e["target"] for e in got] == [f"job:{i}" for i in reversed(ids)]
    assert main(["audit", "--user", "root", "--token", token], http=client) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["TIME", "USER", "ACTION", "TARGET", "CLIENT", "DETAILS"]
    assert len(out) == 2 and "user.quota" in out[1] and "user:alice" in out[1]
    assert "testclient" in out[1] and '{"after":{"share":2.0}' in out[1]
    plain = alice["Authorization"].removeprefix("Bearer ")
    assert main(["audit", "--user", "root", "--token", plain], http=client) == 0
    assert "no audit entries" in capsys.readouterr().out
    sdk = Client(token=token, http=client).audit(action="user.quota")
    assert [e["action"] for e in sdk["items"]] == ["user.quota"] and sdk["next_cursor"] is None
