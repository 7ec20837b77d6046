"""What the dashboard's projects pages read (issue 44, item 9): each project's quota and
usage in GET /v1/projects and GET /v1/projects/{name} (its running and queued jobs, the
workers they hold, its recent worker-hours), `GET /v1/ui/jobs?project=` (404 and 422 as
GET /v1/jobs?project=), and `/projects` and `/projects/NAME` served as the dashboard's
page, not as the API's 404."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from support.db import Factory

from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Worker
from torchyard.store.projects import project_named


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Lab:
    """Project `lab`: olive owns it, max is a member; nora has no role; root is an admin.
    Its jobs: one running on two workers, two queued, one succeeded; olive's personal
    project has one queued job of its own."""

    def __init__(self, client: TestClient, factory: Factory):
        self.client = client
        self.h = {
            "olive": _auth(factory.token("olive")),
            "max": _auth(factory.token("max")),
            "nora": _auth(factory.token("nora")),
            "root": _auth(factory.token("root", admin=True)),
        }
        assert client.post("/v1/projects", json={"name": "lab"}, headers=self.h["olive"]).status_code == 201  # fmt: skip
        r = client.put("/v1/projects/lab/members/max", json={"role": "member"}, headers=self.h["olive"])  # fmt: skip
        assert r.status_code == 200, r.text
        r = client.put("/v1/projects/lab/quota", json={"max_workers": 4, "max_queued": 10},
                       headers=self.h["root"])  # fmt: skip
        assert r.status_code == 200, r.text
        with session_scope(factory.url) as s:
            project = project_named(s, "lab")
            assert project is not None
            pid = project.id
        self.running = factory.job("max", "running", project_id=pid)
        factory.attempt(self.running, workers=2, state="running")
        with session_scope(factory.url) as s:  # its workers are busy with it
            ids = select(Assignment.worker_id).where(Assignment.job_id == self.running)
            s.execute(update(Worker).where(Worker.id.in_(ids)).values(current_job_id=self.running))
        self.queued = [factory.job("olive", "queued", project_id=pid) for _ in range(2)]
        self.done = factory.job("max", "succeeded", project_id=pid)
        self.personal = factory.job("olive", "queued")


@pytest.fixture
def lab(client: TestClient, factory: Factory) -> Lab:
    return Lab(client, factory)


def test_the_list_carries_each_projects_quota_and_usage(client: TestClient, lab: Lab) -> None:
    items = client.get("/v1/projects", headers=lab.h["olive"]).json()["items"]
    by = {p["name"]: p for p in items}
    assert set(by) == {"lab", "~olive"}
    assert by["lab"]["role"] == "owner" and by["lab"]["members"] == 2
    assert by["lab"]["quota"] == {"max_workers": 4, "max_queued": 10, "share": 1.0}
    usage = by["lab"]["usage"]
    assert (usage["running"], usage["queued"], usage["workers"]) == (1, 2, 2)
    assert usage["worker_hours"] >= 0
    assert by["~olive"]["usage"] | {"worker_hours": 0} == {
        "running": 0, "queued": 1, "workers": 0, "worker_hours": 0,
    }  # fmt: skip
    assert by["~olive"]["quota"] == {"max_workers": None, "max_queued": None, "share": 1.0}
    # nora sees only her own; an admin every project
    nora = client.get("/v1/projects", headers=lab.h["nora"]).json()["items"]
    assert [p["name"] for p in nora] == ["~nora"]
    root = client.get("/v1/projects", headers=lab.h["root"]).json()["items"]
    assert {"lab", "~olive", "~max"} <= {p["name"] for p in root}


def test_a_project_shows_its_members_quota_and_usage_to_its_members_only(
    client: TestClient, lab: Lab
) -> None:
    r = client.get("/v1/projects/lab", headers=lab.h["max"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["role"] == "member"
    assert body["members"] == [{"user": "olive", "role": "owner"}, {"user": "max", "role": "member"}]  # fmt: skip
    assert body["quota"]["max_workers"] == 4
    assert (body["usage"]["running"], body["usage"]["queued"], body["usage"]["workers"]) == (1, 2, 2)  # fmt: skip
    for name in ("lab", "no-such-project"):
        r = client.get(f"/v1/projects/{name}", headers=lab.h["nora"])
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/projects/lab", headers=lab.h["root"]).json()["role"] is None


def test_the_dashboard_table_keeps_one_projects_jobs(client: TestClient, lab: Lab) -> None:
    r = client.get("/v1/ui/jobs", params={"project": "lab"}, headers=lab.h["olive"])
    assert r.status_code == 200, r.text
    body = r.json()
    lab_jobs = {lab.running, *lab.queued, lab.done}
    assert {j["id"] for j in body["items"]} == lab_jobs and body["total"] == 4
    assert body["counts"] == {"running": 1, "queued": 2, "succeeded": 1}
    assert {j["project"] for j in body["items"]} == {"lab"}
    both = client.get("/v1/ui/jobs", headers=lab.h["olive"]).json()
    assert {j["id"] for j in both["items"]} == lab_jobs | {lab.personal}
    mine = client.get("/v1/ui/jobs", params={"project": "~olive", "state": "queued"},
                      headers=lab.h["olive"]).json()  # fmt: skip
    assert [j["id"] for j in mine["items"]] == [lab.personal] and mine["total"] == 1
    # an admin reads any project's; someone without a role gets the 404 GET /v1/jobs gives
    admin = client.get("/v1/ui/jobs", params={"project": "lab"}, headers=lab.h["root"]).json()
    assert admin["total"] == 4
    for name in ("lab", "no-such-project"):
        for path in ("/v1/ui/jobs", "/v1/jobs"):
            r = client.get(path, params={"project": name}, headers=lab.h["nora"])
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, name)
    for path in ("/v1/ui/jobs", "/v1/jobs"):
        r = client.get(path, params={"project": "x" * 102}, headers=lab.h["olive"])
        assert r.status_code == 422, (path, r.text)
    assert client.get("/v1/ui/jobs", params={"project": "lab"}).status_code == 401


def test_projects_paths_are_the_dashboards_page(
    app: FastAPI, client: TestClient, tmp_path: Path
) -> None:
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<!doctype html><title>torchyard</title><div id=app>")
    app.state.ui_static = static
    for path in ("/projects", "/projects/lab", "/projects/~olive", "/projects/no-such"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith("text/html") and "id=app" in r.text
        assert "default-src 'none'" in r.headers["content-security-policy"]
    assert client.get("/projects/a/b").status_code == 404  # not a page: the API's answer
