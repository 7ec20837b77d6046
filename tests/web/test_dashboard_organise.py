"""Organising jobs in the dashboard, in a real browser against a real API process, on SQLite
and on PostgreSQL: tags and notes edited on the job page, tag chips in the table filtering
it, "Re-run with changes" through the submit page, archive, and delete after asking."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, finished_job, user_id
from support.worker_cluster import Cluster, wait_for

from torchyard.contracts import spec as job_spec
from torchyard.store.paths import LOG_FILE, job_dir

pytestmark = pytest.mark.browser


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        self.http = httpx.Client(
            base_url=c.url, headers={"Authorization": f"Bearer {self.alice}"}, timeout=30
        )

    def finished(self, name: str, spec: dict[str, Any] | None = None) -> str:
        """A succeeded job of alice's with a log file."""
        with self.c.session() as s:
            jid = finished_job(s, user_id(s, "alice"), name, spec)
        log = job_dir(self.c.storage, jid) / LOG_FILE
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("epoch 1\n")
        return jid

    def job(self, job_id: str) -> httpx.Response:
        return self.http.get(f"/v1/jobs/{job_id}")


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "organise", World)


def test_tags_and_notes_on_the_job_page_and_the_tables_chips(
    world: World, new_page: Callable[[], Any]
) -> None:
    job, other = world.finished("tag-me"), world.finished("untagged")
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    for tag in ("exp-1", "lr:0.1", "exp-1"):  # the repeat changes nothing
        page.fill("#tag-input", tag)
        page.press("#tag-input", "Enter")
        page.wait_for_selector(f"#job-tags .jtag[data-tag='{tag}']")
    wait_for(lambda: world.job(job).json()["tags"] == ["exp-1", "lr:0.1"], 10, "the tags")
    page.fill("#tag-input", "no spaces")
    page.press("#tag-input", "Enter")
    page.wait_for_selector("#organise-message.error-text")
    page.click("#job-tags .jtag[data-tag='lr:0.1'] .remove-tag")
    page.wait_for_selector("#job-tags .jtag[data-tag='lr:0.1']", state="detached")
    wait_for(lambda: world.job(job).json()["tags"] == ["exp-1"], 10, "a tag removed")
    page.fill("#job-notes", "lr too high <b>?</b>")
    page.click("#save-notes")
    wait_for(lambda: world.job(job).json()["notes"] == "lr too high <b>?</b>", 10, "the notes")
    page.reload()
    page.wait_for_selector("#job-tags .jtag[data-tag='exp-1']")
    assert page.input_value("#job-notes") == "lr too high <b>?</b>"

    page.goto(world.base + "/")
    page.wait_for_selector(f"#jobs-table tr[data-id='{job}'] .jtag[data-tag='exp-1']")
    assert page.query_selector(f"#jobs-table tr[data-id='{other}'] .jtag") is None
    page.click(f"#jobs-table tr[data-id='{job}'] .jtag[data-tag='exp-1'] button")
    page.wait_for_selector(f"#jobs-table tr[data-id='{other}']", state="detached")
    ids = page.eval_on_selector_all("#jobs-table tbody tr", "rows => rows.map(r => r.dataset.id)")
    assert ids == [job] and "tag=exp-1" in page.url
    page.click("#clear-tag")
    page.wait_for_selector(f"#jobs-table tr[data-id='{other}']")


def test_rerun_with_changes_opens_the_submit_page_filled_in(
    world: World, new_page: Callable[[], Any]
) -> None:
    job = world.finished("to-rerun", {**SPEC, "optimizer": {"name": "sgd", "lr": 0.5}})
    world.http.patch(f"/v1/jobs/{job}", json={"tags": ["base"]})
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    page.click("#rerun")
    page.wait_for_selector("#rerun-banner p")
    assert f"/submit?rerun={job}" in page.url
    text = page.input_value("#spec-text")
    assert "lr: 0.5" in text and "name: to-rerun" in text and "base" in text
    page.fill("#spec-text", text.replace("lr: 0.5", "lr: 0.05").replace("name: to-rerun", "name: rerun-of-it"))  # fmt: skip
    page.click("#submit")
    page.wait_for_selector("#job-name:text('rerun-of-it')")
    page.wait_for_selector(f"#rerun-of:text('{job[:12]}')")
    new_id = page.url.rsplit("/", 1)[1]
    new, old = world.job(new_id).json(), world.job(job).json()
    assert new["rerun_of"] == job and new["tags"] == ["base"]
    assert new["spec"]["optimizer"]["lr"] == 0.05
    # The rest as it was (the seeded spec was stored as given; the new one normalised).
    norm = job_spec.spec_to_dict(job_spec.parse_spec(old["spec"]))
    for k in set(norm) | set(new["spec"]):
        if k not in ("optimizer", "name", "tags"):
            assert new["spec"].get(k) == norm.get(k), k


def test_archive_and_delete_from_the_job_page(world: World, new_page: Callable[[], Any]) -> None:
    job = world.finished("to-delete")
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    page.click("#archive")
    page.wait_for_selector("#archived-badge")
    assert world.job(job).json()["archived"] is True
    assert page.inner_text("#archive") == "Unarchive"
    page.click("#archive")
    page.wait_for_selector("#archived-badge", state="detached")
    assert world.job(job).json()["archived"] is False
    page.click("#delete")
    page.click("#keep-running")
    time.sleep(0.3)
    assert world.job(job).status_code == 200
    page.click("#delete")
    page.click("#confirm")
    page.wait_for_selector("#jobs-table")
    assert world.job(job).status_code == 404
    assert not job_dir(world.c.storage, job).exists()
    # A job that runs has no Delete button.
    live = world.http.post("/v1/jobs", json={**SPEC, "name": "still-queued"}).json()["id"]
    page.goto(world.base + f"/jobs/{live}")
    page.wait_for_selector("#archive")
    assert page.query_selector("#delete") is None


def test_a_viewer_sees_a_read_only_job_page_and_a_member_the_buttons(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    from sqlalchemy import update

    from torchyard.store.models import Job
    from torchyard.store.projects import project_named

    assert world.http.post("/v1/projects", json={"name": "vision"}).status_code == 201
    tokens = {"vera": token_for(world.c, "vera"), "max": token_for(world.c, "max")}
    for user, role in (("vera", "viewer"), ("max", "member")):
        r = world.http.put(f"/v1/projects/vision/members/{user}", json={"role": role})
        assert r.status_code == 200, r.text
    job = world.finished("shared")
    with world.c.session() as s:
        project = project_named(s, "vision")
        assert project is not None
        s.execute(update(Job).where(Job.id == job).values(project_id=project.id))
    page = new_page()
    login(page, world.base, tokens["vera"], f"/jobs/{job}")
    page.wait_for_selector("#read-only")
    assert "viewer of vision" in page.inner_text("#read-only")
    for button in ("#rerun", "#archive", "#delete", "#tag-input"):
        assert not page.is_visible(button), button
    assert page.inner_text("#job-name") == "shared"  # and everything else is there to read
    shot(page, "viewer-job")
    page = new_page()
    login(page, world.base, tokens["max"], f"/jobs/{job}")
    page.wait_for_selector("#rerun")
    assert page.query_selector("#read-only") is None and page.is_visible("#tag-input")
