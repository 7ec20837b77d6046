"""A project's quota through HTTP on each database backend: GET /v1/projects/{name}/quota
(any role; admins), PUT (admins; each change in the audit trail), a submit or a sweep's
next trial over the project's max_queued, the project in GET /v1/queue, and a fair-share
reason about projects as a member reads it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support.db import SPEC, Factory

from torchyard.scheduler.sweeps import SweepController
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import AuditEntry, Job

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

Headers = dict[str, str]
QUOTA = "/v1/projects/{}/quota"
UNLIMITED = {"max_workers": None, "max_queued": None, "share": 1.0}
SWEEP: dict[str, Any] = {
    "spec": SPEC | {"project": "lab"},
    "space": {"optimizer.lr": {"type": "categorical", "choices": [0.1, 0.01, 0.001]}},
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 3,
    "parallel": 3,
    "sampler": "grid",
}


def _auth(token: str) -> Headers:
    return {"Authorization": f"Bearer {token}"}


def _error(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.fixture
def lab(client: TestClient, factory: Factory) -> dict[str, Headers]:
    """Project `lab` owned by olive, vera a viewer, max a member; nora has no role."""
    h = {u: _auth(factory.token(u)) for u in ("olive", "vera", "max", "nora")}
    assert client.post("/v1/projects", json={"name": "lab"}, headers=h["olive"]).status_code == 201
    for user, role in (("vera", "viewer"), ("max", "member")):
        r = client.put(f"/v1/projects/lab/members/{user}", json={"role": role},
                       headers=h["olive"])  # fmt: skip
        assert r.status_code == 200, r.text
    return h


def _jobs(db_url: str) -> int:
    with session_scope(db_url) as s:
        return len(s.scalars(select(Job.id)).all())


def _quota_entries(db_url: str) -> list[AuditEntry]:
    with session_scope(db_url) as s:
        rows = s.scalars(select(AuditEntry).where(AuditEntry.action == "project.quota"))
        out = list(rows.all())
        s.expunge_all()
        return out


# -- the routes -----------------------------------------------------------------------------------


def test_admins_set_it_and_every_role_reads_it(
    client: TestClient, admin: Headers, lab: dict[str, Headers]
) -> None:
    url = QUOTA.format("lab")
    assert client.get(url, headers=lab["vera"]).json() == {"project": "lab"} | UNLIMITED
    r = client.put(url, json={"max_workers": 4, "max_queued": 20, "share": 2}, headers=admin)
    want = {"project": "lab", "max_workers": 4, "max_queued": 20, "share": 2.0}
    assert r.status_code == 200 and r.json() == want, r.text
    for who in ("olive", "vera", "max"):
        assert client.get(url, headers=lab[who]).json() == want
    assert client.get(url, headers=admin).json() == want
    # fields not given are kept; null removes a limit, a null share goes back to 1
    r = client.put(url, json={"max_workers": None, "share": None}, headers=admin)
    assert r.json() == want | {"max_workers": None, "share": 1.0}


def test_no_role_is_404_and_only_admins_set_it(
    client: TestClient, admin: Headers, lab: dict[str, Headers]
) -> None:
    url = QUOTA.format("lab")
    _error(client.get(url, headers=lab["nora"]), 404, "not_found")
    _error(client.get(QUOTA.format("nowhere"), headers=lab["nora"]), 404, "not_found")
    for who in ("olive", "max", "nora"):  # an owner is no admin
        err = _error(client.put(url, json={"max_workers": 9}, headers=lab[who]), 403, "forbidden")
        assert "admin" in err["message"]
    # refused before the body is read: a bad body is still 403
    _error(client.put(url, json={"x": 1}, headers=lab["olive"]), 403, "forbidden")
    _error(client.put(QUOTA.format("nowhere"), json={"share": 2}, headers=admin), 404, "not_found")
    assert client.get(url, headers=admin).json() == {"project": "lab"} | UNLIMITED


BAD = [
    ({"max_workers": -1}, "max_workers"),
    ({"max_workers": "3"}, "max_workers"),
    ({"max_queued": 10**7}, "max_queued"),
    ({"share": 0}, "share"),
    ({"share": True}, "share"),
    ({"max_priority": 5}, "max_priority"),  # a user's, never a project's
    ({"owner": "olive"}, "owner"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[str(b) for b, _ in BAD])
def test_bad_values_and_unknown_fields_are_422_naming_the_field(
    client: TestClient, admin: Headers, lab: dict[str, Headers], body: dict, field: str
) -> None:
    url = QUOTA.format("lab")
    err = _error(client.put(url, json={"max_queued": 3} | body, headers=admin), 422,
                 "validation_error")  # fmt: skip
    assert [d["field"] for d in err["details"]] == [f"body.{field}"]
    assert client.get(url, headers=admin).json() == {"project": "lab"} | UNLIMITED


def test_a_personal_projects_share_is_its_users(
    client: TestClient, admin: Headers, lab: dict[str, Headers], db_url: str
) -> None:
    url = QUOTA.format("~max")
    err = _error(client.put(url, json={"share": 2, "max_workers": 1}, headers=admin), 422,
                 "validation_error")  # fmt: skip
    assert [d["field"] for d in err["details"]] == ["body.share"]
    assert "/v1/users/{name}/quota" in err["message"]
    assert client.get(url, headers=lab["max"]).json() == {"project": "~max"} | UNLIMITED
    assert _quota_entries(db_url) == []  # nothing changed, nothing recorded
    r = client.put(url, json={"max_workers": 1}, headers=admin)  # its limits are fine
    assert r.status_code == 200 and r.json()["max_workers"] == 1


def test_each_change_is_in_the_audit_trail_for_admins_and_the_owners(
    client: TestClient, admin: Headers, lab: dict[str, Headers], db_url: str
) -> None:
    url = QUOTA.format("lab")
    assert client.put(url, json={"max_queued": 5, "share": 2}, headers=admin).status_code == 200
    assert client.put(url, json={"max_queued": 5}, headers=admin).status_code == 200  # no change
    (entry,) = _quota_entries(db_url)
    assert (entry.user_name, entry.target) == ("root", "project:lab")
    assert entry.details == {
        "before": {"max_queued": None, "share": 1.0},
        "after": {"max_queued": 5, "share": 2.0},
    }
    r = client.get("/v1/audit", headers=lab["olive"], params={"project": "lab"})
    assert [e["action"] for e in r.json()["items"]].count("project.quota") == 1


# -- max_queued -----------------------------------------------------------------------------------


def test_a_submit_over_the_projects_max_queued_is_429_naming_it_and_stores_nothing(
    client: TestClient, admin: Headers, lab: dict[str, Headers], db_url: str
) -> None:
    client.put(QUOTA.format("lab"), json={"max_queued": 1}, headers=admin)
    into_lab = SPEC | {"project": "lab"}
    assert client.post("/v1/jobs", json=into_lab, headers=lab["olive"]).status_code == 201
    before = _jobs(db_url)
    err = _error(client.post("/v1/jobs", json=into_lab, headers=lab["max"]), 429,
                 "quota_exceeded")  # fmt: skip
    assert err["message"] == (
        "project lab already has 1 queued jobs, its quota's max_queued is 1; "
        "wait for some to start or cancel some"
    )
    assert err["details"] == [{"field": "max_queued", "limit": 1, "project": "lab"}]
    assert _jobs(db_url) == before
    # max's own project is not lab's: it takes the submit
    assert client.post("/v1/jobs", json=SPEC, headers=lab["max"]).status_code == 201


def test_with_both_full_the_users_limit_is_named(
    client: TestClient, admin: Headers, lab: dict[str, Headers]
) -> None:
    client.put(QUOTA.format("lab"), json={"max_queued": 1}, headers=admin)
    client.put("/v1/users/max/quota", json={"max_queued": 1}, headers=admin)
    assert client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=lab["max"]).status_code == 201  # fmt: skip
    err = _error(client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=lab["max"]),
                 429, "quota_exceeded")  # fmt: skip
    assert err["message"].startswith("max already has 1 queued jobs, the quota's max_queued is 1")
    assert err["details"] == [{"field": "max_queued", "limit": 1}]


def test_a_sweeps_next_trial_waits_for_room_in_its_project(
    client: TestClient,
    admin: Headers,
    lab: dict[str, Headers],
    factory: Factory,
    settings: Settings,
) -> None:
    client.put(QUOTA.format("lab"), json={"max_queued": 2}, headers=admin)
    other = client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=lab["olive"]).json()
    r = client.post("/v1/sweeps", json=SWEEP, headers=lab["max"])
    assert r.status_code == 201, r.text
    sweep = r.json()["id"]
    assert r.json()["project"] == "lab"
    ctl = SweepController(settings)
    assert ctl.run_pass() == 1  # olive's job and one trial fill lab's 2
    assert ctl.run_pass() == 0  # the next trial waits: not asked for, not failed
    trials = client.get(f"/v1/sweeps/{sweep}", headers=lab["max"]).json()["trials"]
    assert len(trials) == 1 and trials[0]["status"] != "failed"
    factory.set_state(other["id"], "starting")
    assert ctl.run_pass() == 1


# -- what members see -----------------------------------------------------------------------------


def test_the_queue_shows_each_jobs_project(
    client: TestClient, lab: dict[str, Headers], admin: Headers
) -> None:
    team = client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=lab["max"]).json()
    own = client.post("/v1/jobs", json=SPEC, headers=lab["max"]).json()
    items = client.get("/v1/queue", headers=admin).json()["items"]
    assert {i["id"]: i["project"] for i in items} == {team["id"]: "lab", own["id"]: "~max"}
    mine = client.get("/v1/queue", headers=lab["vera"]).json()["items"]  # lab's viewer
    assert [(i["id"], i["project"]) for i in mine] == [(team["id"], "lab")]


def test_a_fair_share_reason_about_projects_names_no_other_project(
    client: TestClient, lab: dict[str, Headers], factory: Factory
) -> None:
    job = client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=lab["max"]).json()
    factory.set_pending(  # scheduler/fairshare.py: wait_prefix, projects compared
        job["id"],
        "fair share: project lab has used 3.0 GPU-h (share 2), project vision 0.4 (share 1) "
        "(half-life 1 day); needs 1 worker, 0 idle",
    )
    for who in ("vera", "max"):
        said = client.get(f"/v1/jobs/{job['id']}", headers=lab[who]).json()["pending_reason"]
        assert said == (
            "fair share: project lab has used 3.0 GPU-h (share 2); projects and users who used "
            "less go first (half-life 1 day); needs 1 worker, 0 idle"
        )
    queue = client.get("/v1/queue", headers=lab["vera"]).text
    assert "vision" not in queue and "0.4" not in queue
