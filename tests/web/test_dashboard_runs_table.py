"""The jobs table as a runs table in a real browser against a real API process (jobs with
params and metrics written straight into the store): the columns chooser (metric and param
columns), a click on a metric's head sorting on the server, a metric filter, all kept in
the URL (a reload shows the same view), and Compare overlaying two chosen metrics of two
jobs, one chart each."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, finished_job, user_id
from support.worker_cluster import Cluster

from torchyard.store.metrics import ingest_metrics

pytestmark = pytest.mark.browser

SHOTS = Path("/tmp/runs-table-shots")  # where the lead looks at them (the `keep` fixture)
# name: (params, {metric: values by step}); created in this order (the newest last)
RUNS: dict[str, tuple[dict[str, Any], dict[str, list[float]]]] = {
    "r-a": ({"lr": 0.1, "arch": "wide"}, {"val/accuracy": [0.6, 0.95], "val/f1": [0.9], "train/loss": [1.0, 0.2]}),
    "r-b": ({"lr": 0.01, "arch": "narrow"}, {"val/accuracy": [0.85], "val/f1": [0.7], "train/loss": [0.4]}),
    "r-c": ({"lr": 1.0, "arch": "wide"}, {"val/accuracy": [0.5], "train/loss": [2.0]}),
    "r-d": ({"lr": 0.001, "arch": "narrow"}, {}),
}  # fmt: skip


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        self.ids: dict[str, str] = {}


def _seed(w: World) -> World:
    with w.c.session() as s:
        uid = user_id(s, "alice")
        for name, (params, metrics) in RUNS.items():
            w.ids[name] = job = finished_job(s, uid, name, {**SPEC, "params": params})
            for metric, values in metrics.items():
                rows = [{"name": metric, "step": 10 * k, "value": v, "time": 0.0} for k, v in enumerate(values)]  # fmt: skip
                ingest_metrics(s, job, rows)
    return w


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "runs-table", lambda c: _seed(World(c)))


def _order(page: Any, w: World) -> list[str]:
    ids = page.eval_on_selector_all("#jobs-table tbody tr", "trs => trs.map(r => r.dataset.id)")
    names = {v: k for k, v in w.ids.items()}
    return [names.get(i, i) for i in ids]


def _wait_order(page: Any, w: World, names: list[str]) -> None:
    ids = [w.ids[n] for n in names]
    page.wait_for_function(
        "ids => JSON.stringify([...document.querySelectorAll('#jobs-table tbody tr')].map(r => r.dataset.id)) === JSON.stringify(ids)",
        arg=ids,
    )  # fmt: skip
    assert _order(page, w) == names


def _heads(page: Any) -> list[str]:
    return list(page.eval_on_selector_all("#jobs-table thead th", "ths => ths.map(t => t.textContent)"))  # fmt: skip


def _cells(page: Any, w: World, name: str) -> dict[str, str]:
    return dict(
        page.eval_on_selector_all(
            f"#jobs-table tr[data-id='{w.ids[name]}'] td.metric",
            "tds => tds.map(t => [t.dataset.metric, t.textContent])",
        )
    )


def _query(page: Any) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query, keep_blank_values=True)


def test_choose_columns_sort_filter_then_compare_two_metrics(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/")
    _wait_order(page, world, ["r-d", "r-c", "r-b", "r-a"])  # newest first
    assert _heads(page) == ["", "name", "state", "progress", "train/loss", "val/accuracy",
                            "lr", "arch", "workers", "age"]  # fmt: skip

    # Columns: val/f1 in, train/loss out; of the params lr only.
    page.click("#columns")
    page.check("#columns-panel input[data-metric='val/f1']")
    page.wait_for_selector("#jobs-table th[data-metric='val/f1']")
    page.uncheck("#columns-panel input[data-metric='train/loss']")
    page.wait_for_selector("#jobs-table th[data-metric='train/loss']", state="detached")
    page.uncheck("#columns-panel input[data-param='arch']")
    page.wait_for_selector("#jobs-table th[data-param='arch']", state="detached")
    assert _heads(page) == ["", "name", "state", "progress", "val/accuracy", "val/f1", "lr",
                            "workers", "age"]  # fmt: skip
    assert _cells(page, world, "r-a") == {"val/accuracy": "0.95", "val/f1": "0.9"}  # latest
    assert _cells(page, world, "r-c") == {"val/accuracy": "0.5", "val/f1": "\N{EN DASH}"}
    q = _query(page)
    assert q["metrics"] == ["val/accuracy,val/f1"] and q["params"] == ["lr"]

    # Sort by a metric's head: descending, then ascending; a job without it last both times.
    page.click("#jobs-table th[data-metric='val/accuracy']")
    _wait_order(page, world, ["r-a", "r-b", "r-c", "r-d"])
    assert page.text_content("#jobs-table th[data-metric='val/accuracy']") == "val/accuracy ▼"
    page.click("#jobs-table th[data-metric='val/accuracy']")
    _wait_order(page, world, ["r-c", "r-b", "r-a", "r-d"])
    assert _query(page)["sort"] == ["metric:val/accuracy:asc"]

    # Filter: val/accuracy > 0.8 (the server counts and pages what it keeps).
    page.select_option("#filter-metric", "val/accuracy")
    page.select_option("#filter-op", "gt")
    page.fill("#filter-value", "0.8")
    page.click("#add-filter")
    _wait_order(page, world, ["r-b", "r-a"])
    assert page.text_content("#range") == "1\N{EN DASH}2 of 2"
    assert (
        page.text_content("#metric-filters .metric-filter")
        == "val/accuracy > 0.8 \N{MULTIPLICATION SIGN}"
    )
    assert _query(page)["filter"] == ["metric:val/accuracy:gt:0.8"]
    keep(page, "runs-table")

    # The URL is the view: a reload shows the same columns, order and filter.
    page.reload()
    _wait_order(page, world, ["r-b", "r-a"])
    assert _heads(page)[4:7] == ["val/accuracy ▲", "val/f1", "lr"]

    # Compare the two over the table's two metrics: one chart per metric, both runs on each.
    for name in ("r-b", "r-a"):
        page.check(f"#jobs-table tr[data-id='{world.ids[name]}'] input[type=checkbox]")
    page.click("#compare")
    page.wait_for_selector("#compare-chart[data-ready='1']")
    page.wait_for_function("() => document.querySelectorAll(\".compare-chart[data-ready='1']\").length === 2")  # fmt: skip
    charts = page.evaluate(
        "() => [...document.querySelectorAll('.compare-chart')].map(el => [el.dataset.metric, el.__chart.sources.map(s => s.job + ' ' + s.name)])"
    )  # fmt: skip
    a, b = world.ids["r-a"], world.ids["r-b"]
    assert [m for m, _ in charts] == ["val/accuracy", "val/f1"]
    for metric, sources in charts:
        assert sorted(sources) == sorted([f"{a} {metric}", f"{b} {metric}"])
    last = page.eval_on_selector_all(
        f"#runs tr[data-id='{a}'] td.num", "tds => tds.map(t => [t.dataset.metric, t.textContent])"
    )
    assert last == [["val/accuracy", "0.95"], ["val/f1", "0.9"]]
    assert _query(page)["metrics"] == ["val/accuracy,val/f1"]
    keep(page, "compare-two-metrics")

    # A third metric ticked on the compare page: a third chart, kept in the URL.
    page.check("#metrics input[data-metric='train/loss']")
    page.wait_for_function("() => document.querySelectorAll(\".compare-chart[data-ready='1']\").length === 3")  # fmt: skip
    assert _query(page)["metrics"] == ["train/loss,val/accuracy,val/f1"]
