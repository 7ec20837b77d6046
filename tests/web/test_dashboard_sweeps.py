"""The sweeps pages in a real browser against a real API process (no scheduler: sweeps are
made through the API, their trials' jobs, curves and rows and their Optuna study written
straight into the store as the controller would leave them), on SQLite and on PostgreSQL:
the list, a sweep's trial table (best and pruned marked, the API's values), its overlaid
curves, parallel coordinates and importances, the compare page's numbers, and cancel."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, SeedTrial, sweep_study, sweep_trials
from support.worker_cluster import Cluster

from torchyard.store.models import Sweep
from torchyard.store.sweeps import finish_sweep

pytestmark = pytest.mark.browser

SHOTS = Path("/tmp/sweep-shots")  # where the lead looks at them (the `keep` fixture)
METRIC = "val/accuracy"
SPACE: dict[str, Any] = {
    "optimizer.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True},
    "optimizer.weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
    "batch_size": {"type": "categorical", "choices": [32, 64, 128]},
}


def curve(final: float, peak: float | None = None, last: int = 50) -> list[tuple[int, float]]:
    """val/accuracy every 10 steps rising to `final` at `last`; with `peak`, above it at
    the middle step first (the curve's maximum is not its final value)."""
    steps = list(range(0, last + 1, 10))
    pts = [(k, round(0.3 + (final - 0.3) * k / last, 4)) for k in steps]
    if peak is not None:
        mid = len(pts) // 2
        pts[mid] = (pts[mid][0], peak)
    return pts


def p(lr: float, wd: float, bs: int) -> dict[str, Any]:
    return {"optimizer.lr": lr, "optimizer.weight_decay": wd, "batch_size": bs}


# #1 peaks at 0.97 but ends at 0.81: the best is #3 (final 0.93), never #1 by its maximum.
DONE = [
    SeedTrial(p(0.001, 0.0, 32), "succeeded", "complete", curve(0.62)),
    SeedTrial(p(0.01, 0.05, 64), "succeeded", "complete", curve(0.81, peak=0.97)),
    SeedTrial(p(0.3, 0.1, 128), "cancelled", "pruned", curve(0.35, last=20)),
    SeedTrial(p(0.05, 0.01, 64), "succeeded", "complete", curve(0.93)),
    SeedTrial(p(0.002, 0.08, 32), "failed", "failed", [], error="job failed: CUDA out of memory"),
]
RUNNING = [
    SeedTrial(p(0.02, 0.03, 128), "running", None, curve(0.7, last=20)),
    SeedTrial(p(0.04, 0.02, 64), "queued", None, curve(0.66, last=10), paused_rung=1),
]
BEST, PRUNED = 3, 2
# Ranges across notations (lr 1e-5 … 0.1, weight decay 0 … 1e-4), and two outliers far below
# the complete and running trials: a pruned trial that collapsed, a failed one that diverged.
WIDE_SPACE: dict[str, Any] = {
    "optimizer.lr": {"type": "float", "low": 1e-5, "high": 0.1, "log": True},
    "optimizer.weight_decay": {"type": "float", "low": 0.0, "high": 1e-4},
    "batch_size": {"type": "categorical", "choices": [32, 64]},
}
WIDE = [
    SeedTrial(p(1e-4, 2e-5, 32), "succeeded", "complete", [(0, 0.8), (10, 0.88), (20, 0.93)]),
    SeedTrial(p(1e-3, 5e-5, 64), "succeeded", "complete", [(0, 0.82), (10, 0.9), (20, 0.95)]),
    SeedTrial(p(1e-2, 8e-5, 32), "running", None, [(0, 0.78), (10, 0.86)]),
    SeedTrial(p(0.05, 1e-5, 64), "cancelled", "pruned", [(0, 0.5), (10, 0.02)]),
    SeedTrial(p(1e-5, 0.0, 32), "failed", "failed", [(0, 0.1), (10, 0.0)], error="diverged"),
]


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice, self.bob = token_for(c, "alice"), token_for(c, "bob")
        self.done = self.running = self.bobs = self.wide = ""

    def api(self, token: str, path: str, method: str = "GET") -> Any:
        r = self.c.http.request(method, path, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code < 300, r.text
        return r.json()

    def new_sweep(self, token: str, name: str, space: dict[str, Any] = SPACE) -> str:
        body = {"name": name, "spec": {**SPEC, "seed": 1}, "space": space,
                "objective": {"metric": METRIC, "mode": "max"}, "trials": len(DONE),
                "parallel": 2, "pruner": "median"}  # fmt: skip
        r = self.c.http.post("/v1/sweeps", json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


def _seed(w: World) -> World:
    w.done, w.running = w.new_sweep(w.alice, "lr-search"), w.new_sweep(w.alice, "still-going")
    w.bobs = w.new_sweep(w.bob, "bobs-sweep")
    w.wide = w.new_sweep(w.alice, "wide-ranges", WIDE_SPACE)
    with w.c.session() as s:
        sweep_trials(s, w.done, DONE)
        sweep_trials(s, w.running, RUNNING)
        sweep_trials(s, w.wide, WIDE)
        done = s.get(Sweep, w.done)
        assert done is not None
        finish_sweep(done, "succeeded")
    sweep_study(w.c.db_url, w.done, DONE)
    sweep_study(w.c.db_url, w.running, RUNNING)
    sweep_study(w.c.db_url, w.wide, WIDE)
    return w


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "sweeps", lambda c: _seed(World(c)))


def _open(world: World, new_page: Callable[[], Any], path: str, token: str | None = None) -> Any:
    page = new_page()
    login(page, world.base, token or world.alice, path)
    return page


def test_the_list_shows_the_users_sweeps(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = _open(world, new_page, "/sweeps")
    row = page.wait_for_selector(f"#sweeps-table tr[data-id='{world.done}']")
    assert row.query_selector("td.name a").text_content() == "lr-search"
    assert row.query_selector(".state").text_content() == "succeeded"
    assert row.query_selector("td.best-value").text_content() == "0.93"
    assert "3 complete · 1 pruned · 1 failed" in row.text_content()
    assert METRIC in row.text_content()
    assert page.query_selector(f"tr[data-id='{world.running}'] .state").text_content() == "running"
    assert page.query_selector(f"tr[data-id='{world.bobs}']") is None  # another user's
    assert page.get_attribute("header nav a.active", "href") == "/sweeps"
    keep(page, "sweeps-list")
    row.query_selector("td.name a").click()
    page.wait_for_url(f"**/sweeps/{world.done}")
    page.wait_for_selector("#trials")


def _trial_rows(page: Any) -> list[dict[str, Any]]:
    return list(
        page.eval_on_selector_all(
            "#trials tbody tr",
            """rows => rows.map(r => ({number: +r.dataset.number, status: r.dataset.status,
                best: !!r.querySelector('.badge-best'), pruned: !!r.querySelector('.status-pruned'),
                value: r.querySelector('td.value').dataset.value ?? null,
                shown: r.querySelector('td.value').textContent}))""",
        )
    )


def test_the_sweep_page_shows_trials_curves_coordinates_and_importances(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    api = world.api(world.alice, f"/v1/sweeps/{world.done}")
    assert api["best"]["number"] == BEST
    page = _open(world, new_page, f"/sweeps/{world.done}")
    page.wait_for_selector("#trial-curves[data-ready='1']")
    page.wait_for_selector("#importances .imp-row")
    rows = _trial_rows(page)
    assert [r["number"] for r in rows] == [t["number"] for t in api["trials"]]
    assert [r["number"] for r in rows if r["best"]] == [BEST]
    assert [r["number"] for r in rows if r["pruned"]] == [PRUNED]
    for r, t in zip(rows, api["trials"], strict=True):
        assert r["status"] == t["status"]
        assert (None if r["value"] is None else float(r["value"])) == t["value"]
    heads = page.eval_on_selector_all("#trials thead th", "ths => ths.map(t => t.textContent)")
    assert heads == ["", "#", "status", "job", "job state", *SPACE, METRIC, "step"]
    _check_curves(page, api)
    _check_parcoords(page, api)
    _check_importances(page, world)
    assert page.query_selector("#cancel") is None  # it has ended
    keep(page, "sweep")


def test_a_pruned_trial_says_pruned_and_links_to_its_sweep(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    """In the jobs table and on its page a pruned trial reads `pruned`, not a plain
    `cancelled` (its state, in the tooltip); a trial's page links to its sweep."""
    trials = {t["number"]: t for t in world.api(world.alice, f"/v1/sweeps/{world.done}")["trials"]}
    pruned, best = trials[PRUNED]["job_id"], trials[BEST]["job_id"]
    page = _open(world, new_page, "/")
    badge = page.wait_for_selector(f"#jobs-table tr[data-id='{pruned}'] .state")
    assert badge.text_content() == "pruned" and "cancelled" in badge.get_attribute("title")
    other = page.query_selector(f"#jobs-table tr[data-id='{best}'] .state")
    assert other.text_content() == "succeeded"
    keep(page, "jobs-with-a-pruned-trial")
    page.goto(f"{world.base}/jobs/{pruned}")
    page.wait_for_selector("#job-state .state-pruned")
    link = page.wait_for_selector("#job-sweep a")
    assert link.get_attribute("href") == f"/sweeps/{world.done}"
    keep(page, "pruned-trial")
    link.click()
    page.wait_for_url(f"**/sweeps/{world.done}")
    page.wait_for_selector("#trials")


def _check_curves(page: Any, api: dict[str, Any]) -> None:
    """One curve per trial with a job; those with points drawn; the best thick, the pruned
    faint; each curve's last point is its trial's value."""
    got = page.evaluate(
        """() => { const c = document.querySelector('#trial-curves').__chart;
        return c.sources.map((s, i) => ({job: s.job, width: s.width, alpha: s.alpha,
            points: c.overview[i].steps.length, last: c.overview[i].values.at(-1) ?? null})); }"""
    )
    by_job = {t["job_id"]: t for t in api["trials"]}
    assert [g["job"] for g in got] == [t["job_id"] for t in api["trials"]]
    assert [g["points"] > 0 for g in got] == [t["value"] is not None for t in api["trials"]]
    for g in got:
        t = by_job[g["job"]]
        assert g["width"] == (3 if t["number"] == BEST else 1.5)
        assert (g["alpha"] is not None) == t["pruned"]
        assert g["last"] == t["value"]
    legend = page.eval_on_selector_all(
        "#trial-curves .legend-label", "els => els.map(e => e.textContent)"
    )
    assert legend[BEST] == f"#{BEST} (best)" and legend[PRUNED] == f"#{PRUNED} (pruned)"


def _check_parcoords(page: Any, api: dict[str, Any]) -> None:
    lines = page.eval_on_selector_all(
        "#parcoords svg polyline.pc-line",
        "ls => ls.map(l => ({n: +l.dataset.number, best: l.classList.contains('best'), "
        "points: l.getAttribute('points').split(' ').length}))",
    )
    with_value = sorted(t["number"] for t in api["trials"] if t["value"] is not None)
    assert sorted(line["n"] for line in lines) == with_value
    assert [line["n"] for line in lines if line["best"]] == [BEST]
    assert lines[-1]["n"] == BEST  # drawn last, on top
    assert {line["points"] for line in lines} == {len(SPACE) + 1}
    axes = page.eval_on_selector_all(
        "#parcoords .pc-axis",
        "as => as.map(a => [a.dataset.name, a.getAttribute('class'), "
        "a.querySelector('.pc-label title').textContent])",
    )
    assert [a[0] for a in axes] == [*SPACE, METRIC]
    assert [a[2] for a in axes] == [*SPACE, METRIC]
    kinds = {a[0]: a[1].split()[-1] for a in axes}
    assert kinds == {"optimizer.lr": "pc-log", "optimizer.weight_decay": "pc-linear",
                     "batch_size": "pc-categorical", METRIC: "pc-linear"}  # fmt: skip
    ticks = page.eval_on_selector_all(
        "#parcoords .pc-axis[data-name='batch_size'] .pc-tick text",
        "ts => ts.map(t => t.textContent)",
    )
    assert ticks == ["32", "64", "128"]


def _check_importances(page: Any, world: World) -> None:
    api = world.api(world.alice, f"/v1/sweeps/{world.done}/importances")
    assert api["trials"] == 3 and set(api["importances"]) == set(SPACE)
    shown = page.eval_on_selector_all(
        "#importances .imp-row", "rs => rs.map(r => [r.dataset.param, +r.dataset.fraction])"
    )
    assert [s[0] for s in shown] == list(api["importances"])  # largest first, as the API
    assert all(math.isclose(f, api["importances"][n]) for n, f in shown)
    assert math.isclose(sum(f for _, f in shown), 1.0, abs_tol=1e-6)
    widths = page.eval_on_selector_all(
        "#importances .imp-fill", "fs => fs.map(f => f.getBoundingClientRect().width)"
    )
    assert widths[0] > 0 and widths == sorted(widths, reverse=True)


def test_compare_shows_final_values_whose_maximum_is_the_best(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    api = world.api(world.alice, f"/v1/sweeps/{world.done}")
    page = _open(world, new_page, f"/compare?sweep={world.done}&metric={METRIC}")
    page.wait_for_selector("#compare-chart[data-ready='1']")
    shown = dict(
        page.eval_on_selector_all(
            "#runs tbody tr", "rs => rs.map(r => [r.dataset.id, r.lastElementChild.textContent])"
        )
    )
    complete = [t for t in api["trials"] if t["status"] == "complete"]
    for t in complete:
        assert shown[t["job_id"]] == str(t["value"])  # the final value, not the curve's peak
    assert max(float(shown[t["job_id"]]) for t in complete) == api["best"]["value"] == 0.93
    keep(page, "sweep-compare")


def test_a_running_sweep_is_cancelled_after_asking(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = _open(world, new_page, f"/sweeps/{world.running}")
    page.wait_for_selector("#no-importances")
    assert "needs at least 2 complete trials (has 0)" in page.text_content("#no-importances")
    assert page.get_attribute("main", "data-state") == "running"
    # Synchronous halving's paused trial: its rung shown, and what it waits for on hover.
    paused = page.wait_for_selector("#trials tr[data-status='paused'] .status-paused")
    assert paused.text_content() == "paused at eval 1"
    assert "waits at this rung" in (paused.get_attribute("title") or "")
    api = world.api(world.alice, f"/v1/sweeps/{world.running}")
    assert [(t["status"], t["paused_at"]) for t in api["trials"]] == [
        ("running", None),
        ("paused", 1),
    ]
    keep(page, "sweep-running")
    page.click("#cancel")
    page.click("#keep-running")
    assert world.api(world.alice, f"/v1/sweeps/{world.running}")["state"] == "running"
    page.click("#cancel")
    page.click("#confirm")
    page.wait_for_selector("main[data-state='cancelled']")
    assert page.query_selector("#cancel") is None
    assert world.api(world.alice, f"/v1/sweeps/{world.running}")["state"] == "cancelled"


def test_each_parallel_axis_ticks_in_one_notation(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    """An axis whose ticks reach below 1e-3 reads them all in exponent form (not 1.000e-5
    beside 0.01); one within 1e-3 … 1e6 all fixed."""
    page = _open(world, new_page, f"/sweeps/{world.wide}")
    page.wait_for_selector("#parcoords .pc-axis")
    ticks = dict(
        page.eval_on_selector_all(
            "#parcoords .pc-axis",
            "as => as.map(a => [a.dataset.name, [...a.querySelectorAll('.pc-tick text')]"
            ".map(t => t.textContent)])",
        )
    )
    assert ticks["optimizer.lr"] == ["1e-5", "1e-4", "1e-3", "1e-2", "1e-1"]
    assert ticks["optimizer.weight_decay"] == ["0", "5e-5", "1e-4"]
    sci, fixed = re.compile(r"^(0|-?\d(\.\d+)?e-?\d+)$"), re.compile(r"^-?[\d,]+(\.\d+)?$")
    for name, labels in ticks.items():
        if name == "batch_size":
            continue
        assert all(sci.match(t) for t in labels) or all(fixed.match(t) for t in labels), ticks
    keep(page, "sweep-wide-ranges")


_Y_RANGE = "() => { const u = document.querySelector('#trial-curves').__chart.u; return [u.scales.y.min, u.scales.y.max]; }"


def test_the_curves_y_range_follows_the_trials_that_matter(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    """By default the y range covers the complete and running trials (0.78 … 0.95), not
    the pruned one that collapsed to 0.02 nor the failed one at 0; "include outliers"
    brings them in, and unticked the range is theirs again."""
    page = _open(world, new_page, f"/sweeps/{world.wide}")
    page.wait_for_selector("#trial-curves[data-ready='1']")
    lo, hi = page.evaluate(_Y_RANGE)
    assert 0.5 < lo <= 0.78 and 0.95 <= hi < 1.2, (lo, hi)
    assert not page.is_checked("#outliers")
    keep(page, "sweep-curves-without-outliers")
    page.check("#outliers")
    lo, hi = page.evaluate(_Y_RANGE)
    assert lo <= 0.0 and hi >= 0.95, (lo, hi)
    keep(page, "sweep-curves-with-outliers")
    page.uncheck("#outliers")
    assert page.evaluate(_Y_RANGE)[0] > 0.5
    # The done sweep has no outlier below its complete trials' curves: every curve shown.
    page.goto(f"{world.base}/sweeps/{world.done}")
    page.wait_for_selector("#trial-curves[data-ready='1']")
    lo, hi = page.evaluate(_Y_RANGE)
    assert lo <= 0.3 and hi >= 0.97, (lo, hi)


def test_another_users_sweep_is_not_found(world: World, new_page: Callable[[], Any]) -> None:
    page = _open(world, new_page, f"/sweeps/{world.done}", token=world.bob)
    page.wait_for_selector("text=Sweep not found")
    assert page.query_selector("#trials") is None
