"""The job page's System panel in a real browser against a real API process (SQLite and
PostgreSQL): a job with system series (seeded in the store as a worker writes them: steps
are Unix seconds) shows them in section#system, one chart per quantity with a curve per
rank, on a time axis, and none of them among the training charts; a job without them has
no System panel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import finished_job, user_id
from support.worker_cluster import Cluster

from torchyard.store.metrics import ingest_metrics

pytestmark = pytest.mark.browser

T0 = 1_780_000_000


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        with c.session() as s:
            uid = user_id(s, "alice")
            self.plain = finished_job(s, uid, "no-samples")
            self.sampled = finished_job(s, uid, "sampled")
            rows = [{"name": "train/loss", "step": k, "value": 1.0 / k, "time": 0.0} for k in range(1, 20)]  # fmt: skip
            ingest_metrics(s, self.plain, rows)
            for name, base in (("sys/cpu_percent", 90.0), ("sys/rank1/cpu_percent", 60.0),
                               ("sys/rss_bytes", 3.0 * 2**30)):  # fmt: skip
                rows += [{"name": name, "step": T0 + 5 * i, "value": base + i, "time": T0 + 5 * i + 0.5}
                         for i in range(30)]  # fmt: skip
            ingest_metrics(s, self.sampled, rows)


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "system", World)


def test_the_system_panel_shows_sys_series_by_time(
    world: World, new_page: Callable[[], Any]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{world.sampled}")
    cpu = "#system .chart[data-quantity='cpu_percent'][data-ready='1']"
    page.wait_for_selector(cpu)
    page.wait_for_selector("#system .chart[data-quantity='rss_bytes'][data-ready='1']")
    assert page.is_visible("#system") and page.inner_text("#system h2") == "System"
    got = page.evaluate(
        """(sel) => {
          const c = document.querySelector(sel).__chart;
          return { names: c.sources.map((s) => s.name), labels: c.sources.map((s) => s.label),
                   time: c.u.scales.x.time, xs: [c.u.data[0][0], c.u.data[0].at(-1)] };
        }""",
        cpu,
    )
    assert got["names"] == ["sys/cpu_percent", "sys/rank1/cpu_percent"]
    assert got["labels"] == ["rank 0", "rank 1"] and got["time"] is True
    assert got["xs"] == [T0, T0 + 5 * 29]  # Unix seconds, not steps
    legend = page.inner_text("#system .chart[data-quantity='rss_bytes'] .legend")
    assert "3.0 GiB" in legend  # the last of 3 GiB + 29 bytes, as bytes
    # The training charts have the training curves only.
    page.wait_for_selector("#charts .chart[data-group='loss'][data-ready='1']")
    groups = page.eval_on_selector_all("#charts .chart", "els => els.map(e => e.dataset.group)")
    assert groups == ["loss"]


def test_a_job_without_samples_has_no_system_panel(
    world: World, new_page: Callable[[], Any]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{world.plain}")
    page.wait_for_selector("#charts .chart[data-group='loss'][data-ready='1']")
    assert not page.is_visible("#system")
    assert page.query_selector("#system .chart") is None
