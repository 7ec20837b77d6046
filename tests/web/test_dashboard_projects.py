"""Projects in the dashboard (issue 44, item 9), in a real browser against a real API
process: `/projects` lists the caller's projects (their role, members, running and queued
jobs, workers and queued jobs against the quota), `/projects/NAME` shows a project's members
and roles, its quota and usage and its newest jobs, the jobs table filters by project (kept
in the URL), and someone with no role in a team's project gets "not found" for its page,
as the API answers them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, finished_job, user_id
from support.worker_cluster import Cluster

from torchyard.store.jobs import create_job
from torchyard.store.models import Job, Worker, utcnow
from torchyard.store.projects import project_named
from torchyard.store.states import transition

pytestmark = pytest.mark.browser

SHOTS = Path("/tmp/projects-shots")  # where the lead looks at them (the `keep` fixture)


class World:
    """Team project `vision`: olive owns it, max is a member; its quota max_workers 4,
    max_queued 5. Its jobs: max's finished one, olive's queued one, max's running one (on a
    busy worker). olive also has a job in her personal project; nora has no role in vision
    and a team project of her own, `nora-lab`."""

    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.tokens = {u: token_for(c, u) for u in ("olive", "max", "nora")}
        self.jobs: dict[str, str] = {}

    def api(self, user: str | None) -> httpx.Client:
        token = self.tokens[user] if user else self.c.token
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {token}"})

    def ids(self, *names: str) -> set[str]:
        return {self.jobs[n] for n in names}


def _seed(w: World) -> World:
    olive, nora, admin = w.api("olive"), w.api("nora"), w.api(None)
    assert olive.post("/v1/projects", json={"name": "vision"}).status_code == 201
    assert olive.put("/v1/projects/vision/members/max", json={"role": "member"}).status_code == 200  # fmt: skip
    assert nora.post("/v1/projects", json={"name": "nora-lab"}).status_code == 201
    r = admin.put("/v1/projects/vision/quota", json={"max_workers": 4, "max_queued": 5})
    assert r.status_code == 200, r.text
    with w.c.session() as s:
        project = project_named(s, "vision")
        assert project is not None
        uid = {u: user_id(s, u) for u in ("olive", "max", "nora")}
        for name, owner in (("vision-done", "max"), ("olive-own", "olive")):
            w.jobs[name] = finished_job(s, uid[owner], name)
        queued, _ = create_job(
            s, uid["olive"], {**SPEC, "name": "vision-queued"}, name="vision-queued"
        )
        running, _ = create_job(
            s, uid["max"], {**SPEC, "name": "vision-running"}, name="vision-running"
        )
        for to in ("starting", "running"):
            transition(s, running, to, reason="seeded")
        w.jobs["vision-queued"], w.jobs["vision-running"] = queued.id, running.id
        w.jobs["nora-job"] = finished_job(s, uid["nora"], "nora-job")
        for name in ("vision-done", "vision-queued", "vision-running"):
            job = s.get(Job, w.jobs[name])
            assert job is not None
            job.project_id = project.id
        s.add(Worker(id="w-vision", host="gpu-host", pid=1, queue="q.w-vision", state="busy",
                     current_job_id=running.id, last_heartbeat=utcnow()))  # fmt: skip
    return w


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "projects", lambda c: _seed(World(c)))


def _row_ids(page: Any, table: str) -> set[str]:
    return set(page.eval_on_selector_all(f"{table} tbody tr[data-id]", "rs => rs.map(r => r.dataset.id)"))  # fmt: skip


def _wait_rows(page: Any, n: int) -> None:
    """Until the jobs table shows `n` jobs."""
    page.wait_for_function(
        "(n) => document.querySelectorAll('#jobs-table tbody tr[data-id]').length === n", arg=n
    )


def _cells(page: Any, row: str) -> list[str]:
    return [c.strip() for c in page.eval_on_selector_all(f"{row} td", "tds => tds.map(t => t.innerText)")]  # fmt: skip


def test_the_projects_page_lists_each_with_role_members_jobs_and_quota(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.tokens["olive"], "/projects")
    page.wait_for_selector("#projects-table tr[data-project='vision']")
    assert page.inner_text("header nav a.active") == "Projects"
    names = page.eval_on_selector_all("#projects-table tbody tr", "rs => rs.map(r => r.dataset.project)")  # fmt: skip
    assert names == ["vision", "~olive"]  # hers only: not nora-lab
    vision = _cells(page, "#projects-table tr[data-project='vision']")
    # project, role, members, running, queued (of max_queued), workers (of max_workers)
    assert vision[:6] == ["vision", "owner", "2", "1", "1 of 5", "1 of 4"], vision
    own = _cells(page, "#projects-table tr[data-project='~olive']")
    assert own[0] == "~olive personal" and own[1] == "owner" and own[2] == "1"
    assert own[4] == "0 · no limit" and own[5] == "0 · no limit", own
    keep(page, "projects-list")
    page.click("#projects-table tr[data-project='vision'] a")
    page.wait_for_selector("#members-table")
    assert page.url == world.base + "/projects/vision"


def test_a_projects_page_shows_members_roles_quota_usage_and_its_jobs(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.tokens["max"], "/projects/vision")
    page.wait_for_selector("#members-table tr[data-user='olive']")
    assert page.inner_text("#project-name") == "vision"
    assert page.inner_text("#project-role") == "Your role: member"
    members = page.eval_on_selector_all(
        "#members-table tbody tr", "rs => rs.map(r => [r.dataset.user, r.querySelector('.role').innerText])"
    )  # fmt: skip
    assert members == [["olive", "owner"], ["max", "member"]]
    assert page.inner_text("#usage-workers").startswith("1 of 4")
    assert page.inner_text("#usage-queued").startswith("1 of 5")
    assert page.inner_text("#usage-running") == "1"
    assert page.inner_text("#quota-share") == "1"
    assert _row_ids(page, "#project-jobs") == world.ids("vision-done", "vision-queued", "vision-running")  # fmt: skip
    owners = page.eval_on_selector_all("#project-jobs tbody tr td:nth-child(2)", "tds => tds.map(t => t.innerText)")  # fmt: skip
    assert sorted(owners) == ["max", "max", "olive"]
    keep(page, "project-page")
    page.click("#project-all-jobs")
    page.wait_for_function("() => document.querySelector('#project-filter')?.value === 'vision'")
    _wait_rows(page, 3)
    assert "project=vision" in page.url
    assert _row_ids(page, "#jobs-table") == world.ids("vision-done", "vision-queued", "vision-running")  # fmt: skip


def test_the_jobs_page_filters_by_project_in_the_url(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.tokens["olive"], "/")
    page.wait_for_selector("#project-filter[data-loaded='1']")
    every = world.ids("vision-done", "vision-queued", "vision-running", "olive-own")
    _wait_rows(page, 4)
    assert _row_ids(page, "#jobs-table") == every
    options = page.eval_on_selector_all("#project-filter option", "os => os.map(o => o.value)")
    assert options == ["", "vision", "~olive"]
    page.select_option("#project-filter", "~olive")
    _wait_rows(page, 1)
    assert _row_ids(page, "#jobs-table") == world.ids("olive-own")
    assert "project=%7Eolive" in page.url or "project=~olive" in page.url
    page.select_option("#project-filter", "vision")
    _wait_rows(page, 3)
    assert "project=vision" in page.url
    page.reload()  # the URL keeps the filter
    page.wait_for_selector("#project-filter[data-loaded='1']")
    _wait_rows(page, 3)
    assert page.input_value("#project-filter") == "vision"
    assert _row_ids(page, "#jobs-table") == world.ids("vision-done", "vision-queued", "vision-running")  # fmt: skip
    keep(page, "jobs-project-filter")
    page.select_option("#project-filter", "")
    _wait_rows(page, 4)
    assert "project=" not in page.url


def test_someone_without_a_role_gets_not_found_for_a_teams_project(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.tokens["nora"], "/projects/vision")
    page.wait_for_selector("#not-found")
    assert page.inner_text("#not-found") == "Project not found"
    assert "vision" not in page.inner_text("main").replace("No project vision", "")
    assert page.query_selector("#members-table") is None
    keep(page, "project-not-found")
    for name in ("no-such-project", "~olive"):  # one that does not exist reads the same
        page.goto(world.base + f"/projects/{name}")
        page.wait_for_selector("#not-found")
    page.goto(world.base + "/projects")
    page.wait_for_selector("#projects-table tr[data-project='nora-lab']")
    names = page.eval_on_selector_all("#projects-table tbody tr", "rs => rs.map(r => r.dataset.project)")  # fmt: skip
    assert names == ["nora-lab", "~nora"]
    # the jobs table narrowed to it by hand: the API's 404, and no rows
    page.goto(world.base + "/?project=vision")
    page.wait_for_function(
        "() => document.querySelector('#live')?.textContent === 'project not found'"
    )
    assert _row_ids(page, "#jobs-table") == set()
