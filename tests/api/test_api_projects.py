"""Projects (issue 28): the routes, and the permission matrix: role by action by object kind
over REST, the event stream, the dashboard's table, the queue and the workers, on SQLite and
PostgreSQL. A project's job is a 404 to whoever has no role in it; a viewer reads, a member
also submits, cancels, edits and deletes their own, an owner also manages members and
deletes any job; admins act as owners everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from support.db import SPEC, STATE_PATHS, Factory

from torchyard.store.db import session_scope
from torchyard.store.jobs import Viewer, get_job
from torchyard.store.models import Job, Project, ProjectMember
from torchyard.store.projects import personal_project_id
from torchyard.store.states import transition

ROLES = ("none", "viewer", "member", "owner", "admin")


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Team:
    """Project `lab` owned by olive, with vera (viewer), max (member) and nora (no role),
    and root (admin, no role). Each person's headers by role name."""

    def __init__(self, client: TestClient, factory: Factory):
        self.client, self.factory = client, factory
        self.h = {
            "owner": _auth(factory.token("olive")),
            "viewer": _auth(factory.token("vera")),
            "member": _auth(factory.token("max")),
            "none": _auth(factory.token("nora")),
            "admin": _auth(factory.token("root", admin=True)),
        }
        r = client.post("/v1/projects", json={"name": "lab"}, headers=self.h["owner"])
        assert r.status_code == 201, r.text
        for user, role in (("vera", "viewer"), ("max", "member")):
            r = client.put(f"/v1/projects/lab/members/{user}", json={"role": role},
                           headers=self.h["owner"])  # fmt: skip
            assert r.status_code == 200, r.text

    def job(self, by: str = "owner", state: str = "succeeded") -> str:
        """A job in `lab`, submitted over the API by `by`, then driven to `state`."""
        r = self.client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=self.h[by])
        assert r.status_code == 201, r.text
        job_id: str = r.json()["id"]
        if state != "queued":
            with session_scope(self.factory.url) as s:
                found = get_job(s, Viewer(0, True), job_id)
                assert found is not None
                for to in STATE_PATHS[state]:
                    transition(s, found[0], to, reason="test")
        return job_id


@pytest.fixture
def team(client: TestClient, factory: Factory) -> Team:
    return Team(client, factory)


# --- the routes ------------------------------------------------------------------------------


def test_every_user_has_a_personal_project_and_jobs_land_there(
    client: TestClient, team: Team
) -> None:
    r = client.post("/v1/jobs", json=SPEC, headers=team.h["member"])
    assert r.status_code == 201 and r.json()["project"] == "~max"
    mine = client.get("/v1/projects", headers=team.h["member"]).json()["items"]
    assert {(p["name"], p["role"], p["personal"]) for p in mine} == {
        ("~max", "owner", True),
        ("lab", "member", False),
    }
    lab = client.get("/v1/projects/lab", headers=team.h["viewer"]).json()
    assert lab["members"] == [
        {"user": "olive", "role": "owner"},
        {"user": "max", "role": "member"},
        {"user": "vera", "role": "viewer"},
    ]
    everyone = client.get("/v1/projects", headers=team.h["admin"]).json()["items"]
    assert {"lab", "~olive", "~vera", "~max", "~nora", "~root"} <= {p["name"] for p in everyone}


def test_project_names_are_checked_and_unique(client: TestClient, team: Team) -> None:
    for bad in ("", "-x", "a b", "~me", "x" * 101, "a/b"):
        r = client.post("/v1/projects", json={"name": bad}, headers=team.h["none"])
        assert r.status_code == 422, bad
    r = client.post("/v1/projects", json={"name": "lab"}, headers=team.h["none"])
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    r = client.post("/v1/projects", json={"name": "ok", "extra": 1}, headers=team.h["none"])
    assert r.status_code == 422


def test_a_project_keeps_an_owner(client: TestClient, team: Team) -> None:
    owner = team.h["owner"]
    r = client.put("/v1/projects/lab/members/olive", json={"role": "member"}, headers=owner)
    assert r.status_code == 409 and "must keep an owner" in r.json()["error"]["message"]
    assert client.delete("/v1/projects/lab/members/olive", headers=owner).status_code == 409
    r = client.put("/v1/projects/lab/members/max", json={"role": "owner"}, headers=owner)
    assert r.status_code == 200
    r = client.delete("/v1/projects/lab/members/olive", headers=owner)  # now max owns it
    assert r.status_code == 200 and r.json()["role"] is None
    assert client.get("/v1/projects/lab", headers=owner).status_code == 404
    bad = client.put(
        "/v1/projects/lab/members/vera", json={"role": "boss"}, headers=team.h["member"]
    )
    assert bad.status_code == 422
    gone = client.put("/v1/projects/lab/members/nobody", json={"role": "viewer"},
                      headers=team.h["member"])  # fmt: skip
    assert gone.status_code == 404


def test_anyone_may_leave_but_only_owners_remove_others(client: TestClient, team: Team) -> None:
    r = client.delete("/v1/projects/lab/members/max", headers=team.h["viewer"])
    assert r.status_code == 403
    r = client.delete("/v1/projects/lab/members/vera", headers=team.h["viewer"])
    assert r.status_code == 200
    assert client.get("/v1/projects/lab", headers=team.h["viewer"]).status_code == 404


def test_a_job_stored_without_a_project_lands_in_its_owners_personal_one(
    factory: Factory, db_url: str
) -> None:
    job_id = factory.job("alice")  # store.jobs.create_job with no project given
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.project_id == personal_project_id(s, job.owner_id)


# --- the matrix ------------------------------------------------------------------------------

# What each role gets: a status code per (action, role). 404 for no role: the job's
# existence is not told.
EXPECTED: dict[str, dict[str, int]] = {
    "show": {"none": 404, "viewer": 200, "member": 200, "owner": 200, "admin": 200},
    "metrics": {"none": 404, "viewer": 200, "member": 200, "owner": 200, "admin": 200},
    "logs": {"none": 404, "viewer": 200, "member": 200, "owner": 200, "admin": 200},
    "checkpoints": {"none": 404, "viewer": 200, "member": 200, "owner": 200, "admin": 200},
    "cancel": {"none": 404, "viewer": 403, "member": 202, "owner": 202, "admin": 202},
    "tag": {"none": 404, "viewer": 403, "member": 200, "owner": 200, "admin": 200},
    "archive": {"none": 404, "viewer": 403, "member": 200, "owner": 200, "admin": 200},
    # the job is the owner's: a member may delete only their own
    "delete": {"none": 404, "viewer": 403, "member": 403, "owner": 204, "admin": 204},
}


def _do(client: TestClient, action: str, job_id: str, h: dict[str, str]) -> Any:
    path = f"/v1/jobs/{job_id}"
    calls: dict[str, Callable[[], Any]] = {
        "show": lambda: client.get(path, headers=h),
        "metrics": lambda: client.get(f"{path}/metrics", headers=h),
        "logs": lambda: client.get(f"{path}/logs", headers=h),
        "checkpoints": lambda: client.get(f"{path}/checkpoints", headers=h),
        "cancel": lambda: client.post(f"{path}/cancel", headers=h),
        "tag": lambda: client.patch(path, json={"tags": ["x"]}, headers=h),
        "archive": lambda: client.post(f"{path}/archive", headers=h),
        "delete": lambda: client.delete(path, headers=h),
    }
    return calls[action]()


@pytest.mark.parametrize("action", list(EXPECTED))
def test_role_by_action_on_a_projects_job(client: TestClient, team: Team, action: str) -> None:
    for role in ROLES:
        # a fresh job per role: cancel and delete change it
        job_id = team.job(state="running" if action == "cancel" else "succeeded")
        r = _do(client, action, job_id, team.h[role])
        assert r.status_code == EXPECTED[action][role], (action, role, r.text)
        if r.status_code in (403, 404):
            assert r.json()["error"]["code"] == (
                "forbidden" if r.status_code == 403 else "not_found"
            )
            # refused: the job is as it was
            after = client.get(f"/v1/jobs/{job_id}", headers=team.h["owner"]).json()
            assert after["state"] == ("running" if action == "cancel" else "succeeded")
            assert after["tags"] == [] and not after["archived"]


def test_a_member_deletes_their_own_job(client: TestClient, team: Team) -> None:
    job_id = team.job(by="member")
    assert client.delete(f"/v1/jobs/{job_id}", headers=team.h["member"]).status_code == 204
    assert client.get(f"/v1/jobs/{job_id}", headers=team.h["owner"]).status_code == 404


@pytest.mark.parametrize("role", ROLES)
def test_role_by_submit_into_a_project(client: TestClient, team: Team, role: str) -> None:
    r = client.post("/v1/jobs", json=SPEC | {"project": "lab"}, headers=team.h[role])
    expected = {"none": 422, "viewer": 403, "member": 201, "owner": 201, "admin": 201}[role]
    assert r.status_code == expected, (role, r.text)
    if expected == 422:  # the same words whether the project exists or not
        assert r.json()["error"]["details"] == [
            {"field": "project", "message": "no project 'lab' that you are in"}
        ]
        nothing = client.post("/v1/jobs", json=SPEC | {"project": "nope"}, headers=team.h[role])
        assert (
            nothing.json()["error"]["details"][0]["message"] == "no project 'nope' that you are in"
        )
    if expected == 201:
        assert r.json()["project"] == "lab"


@pytest.mark.parametrize("role", ROLES)
def test_role_by_member_management(client: TestClient, team: Team, role: str) -> None:
    r = client.put("/v1/projects/lab/members/nora", json={"role": "viewer"}, headers=team.h[role])
    expected = {"none": 404, "viewer": 403, "member": 403, "owner": 200, "admin": 200}[role]
    assert r.status_code == expected, (role, r.text)
    shown = client.get("/v1/projects/lab", headers=team.h[role])
    assert shown.status_code == (404 if role == "none" else 200)


@pytest.mark.parametrize("role", ROLES)
def test_role_by_list_queue_and_workers(
    client: TestClient, team: Team, factory: Factory, role: str
) -> None:
    queued, running = team.job(state="queued"), team.job(state="running")
    factory.worker("w-lab", state="busy", current_job_id=running)
    listed = client.get("/v1/jobs", params={"project": "lab"}, headers=team.h[role])
    if role == "none":
        assert listed.status_code == 404
        assert client.get("/v1/jobs", headers=team.h[role]).json()["items"] == []
    else:
        assert {j["id"] for j in listed.json()["items"]} == {queued, running}
    queue = client.get("/v1/queue", headers=team.h[role]).json()["items"]
    assert ([q["id"] for q in queue] == [queued]) is (role != "none")
    workers = client.get("/v1/workers", headers=team.h[role]).json()["items"]
    shown = next(w for w in workers if w["id"] == "w-lab")["current_job_id"]
    assert shown == (None if role == "none" else running)


@pytest.mark.parametrize("role", ROLES)
def test_role_by_dashboard_table(client: TestClient, team: Team, role: str) -> None:
    job_id = team.job()
    rows = client.get("/v1/ui/jobs", headers=team.h[role]).json()["items"]
    assert (job_id in {r["id"] for r in rows}) is (role != "none")
    assert all(r["project"] == "lab" for r in rows if r["id"] == job_id)


@pytest.mark.parametrize("role", ROLES)
def test_role_by_sweep(client: TestClient, team: Team, role: str) -> None:
    body = {
        "spec": SPEC | {"project": "lab"},
        "space": {"optimizer.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
        "objective": {"metric": "val/loss", "mode": "min"},
        "trials": 2,
    }
    made = client.post("/v1/sweeps", json=body, headers=team.h["owner"])
    assert made.status_code == 201, made.text
    assert made.json()["project"] == "lab"
    sweep_id = made.json()["id"]
    shown = client.get(f"/v1/sweeps/{sweep_id}", headers=team.h[role])
    assert shown.status_code == (404 if role == "none" else 200)
    cancel = client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=team.h[role])
    expected = {"none": 404, "viewer": 403, "member": 202, "owner": 202, "admin": 202}[role]
    assert cancel.status_code == expected, (role, cancel.text)
    mine = client.post("/v1/sweeps", json=body, headers=team.h[role])
    assert mine.status_code == {"none": 422, "viewer": 403}.get(role, 201), (role, mine.text)


def test_a_role_taken_away_counts_at_the_next_request(client: TestClient, team: Team) -> None:
    job_id = team.job()
    assert client.get(f"/v1/jobs/{job_id}", headers=team.h["viewer"]).status_code == 200
    r = client.delete("/v1/projects/lab/members/vera", headers=team.h["owner"])
    assert r.status_code == 200
    assert client.get(f"/v1/jobs/{job_id}", headers=team.h["viewer"]).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/metrics", headers=team.h["viewer"]).status_code == 404


def test_an_event_stream_ends_when_the_role_goes(app: Any, client: TestClient, team: Team) -> None:
    app.state.stream_recheck_s = 0.05
    job_id = team.job(state="running")
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=team.h["viewer"]) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any("queued" in line for line in lines if line.startswith("data:"))
        gone = client.delete("/v1/projects/lab/members/vera", headers=team.h["owner"])
        assert gone.status_code == 200
        deadline = time.monotonic() + 5
        for _ in lines:  # drains until the server ends the stream (a ping comes every 15 s)
            assert time.monotonic() < deadline, "the stream outlived the viewer's role"
    again = client.get(f"/v1/jobs/{job_id}/events", headers=team.h["viewer"])
    assert again.status_code == 404


def test_member_rows_cascade_nothing_else(db_url: str, team: Team) -> None:
    """Leaving a project removes one membership row and nothing of the project's jobs."""
    job_id = team.job()
    with session_scope(db_url) as s:
        before = s.scalar(select(func.count()).select_from(ProjectMember))
        lab = s.scalar(select(Project.id).where(Project.name == "lab"))
    team.client.delete("/v1/projects/lab/members/max", headers=team.h["member"])
    with session_scope(db_url) as s:
        assert s.scalar(select(func.count()).select_from(ProjectMember)) == before - 1
        job = s.get(Job, job_id)
        assert job is not None and job.project_id == lab
