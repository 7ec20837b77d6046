"""The job page's log search, in a real browser against a real API process (SQLite and
PostgreSQL): a line far before the tail the page loads is found through the server's
search, shown with its context; "more" goes on until the log's end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import finished_job, user_id
from support.worker_cluster import Cluster

from torchyard.store.paths import LOG_FILE, job_dir

pytestmark = pytest.mark.browser


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")

    def job_with_log(self, name: str, data: bytes) -> str:
        with self.c.session() as s:
            jid = finished_job(s, user_id(s, "alice"), name)
        log = job_dir(self.c.storage, jid) / LOG_FILE
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(data)
        return jid


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "logsearch", World)


FILLER = b"".join(b"step %07d loss 0.25\n" % i for i in range(40_000))  # ~1 MB


def test_search_finds_a_line_the_page_never_loaded(
    world: World, new_page: Callable[[], Any]
) -> None:
    data = b"warm up\nCUDA error: Magic-Needle <b>not markup</b>\nafter it\n" + FILLER
    job = world.job_with_log("searched", data)
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    page.wait_for_selector("#log:has-text('step 0039999')")  # the tail is loaded
    assert "Magic-Needle" not in page.inner_text("#log")
    page.fill("#log-search", "magic-needle")
    page.press("#log-search", "Enter")
    page.wait_for_selector("#log-search-status:text('0 matches')")
    assert page.query_selector("#log-matches .log-line") is None  # case matters ...
    page.check("#log-search-ignore-case")  # ... unless asked
    hit = page.wait_for_selector("#log-matches .log-line.hit")
    assert "CUDA error: Magic-Needle <b>not markup</b>" in hit.inner_text()
    assert hit.get_attribute("data-offset") == str(data.index(b"CUDA"))
    lines = page.eval_on_selector_all(
        "#log-matches .log-line", "els => els.map(e => e.textContent)"
    )
    assert lines == [
        "0 warm up",
        "8 CUDA error: Magic-Needle <b>not markup</b>",
        f"{data.index(b'after')} after it",
        f"{data.index(b'step 0000000')} step 0000000 loss 0.25",
    ]
    assert page.is_hidden("#log-more")


def test_more_goes_on_to_the_end(world: World, new_page: Callable[[], Any]) -> None:
    data = FILLER + b"".join(b"hit %d\n" % i for i in range(150))  # 100 a request
    job = world.job_with_log("many", data)
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    page.fill("#log-search", "hit ")
    page.press("#log-search", "Enter")
    page.wait_for_selector("#log-search-status:text('100 matches')")
    assert page.is_visible("#log-more")
    page.click("#log-more")
    page.wait_for_selector("#log-search-status:text('150 matches')")
    assert page.is_hidden("#log-more")
    assert page.locator("#log-matches .log-line.hit").count() == 150
    assert page.locator("#log-matches .log-line.hit").last.inner_text().endswith("hit 149")
