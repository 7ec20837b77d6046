"""The dashboard in a real browser against a real API process (no workers: jobs are put
where each test needs them, and curves are written straight into the store), on SQLite and
on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
from dashboard_lib import login, start_api, token_for
from seed import SPEC, finished_job, long_curve_job, loss_curve, many_jobs, user_id
from worker_cluster import ROOT, Cluster

from torchyard.store.metrics import ingest_metrics
from torchyard.store.paths import LOG_FILE, job_dir

pytestmark = pytest.mark.browser

N = 1_000_000
SPIKE_AT = 700_001
XSS = "<img src=x onerror=window.__xss=1><script>window.__xss=2</script>"


class World:
    """The server and what the tests find in it."""

    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        self.bob = token_for(c, "bob")
        self.carol = token_for(c, "carol")
        self.jobs: dict[str, str] = {}

    def as_user(self, token: str) -> Any:
        import httpx

        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip


def _seed(w: World) -> None:
    with w.c.session() as s:
        alice, bob, carol = user_id(s, "alice"), user_id(s, "bob"), user_id(s, "carol")
        many_jobs(s, carol, 10_000)
        w.jobs["million"] = long_curve_job(s, alice, "million-steps", N, SPIKE_AT)
        w.jobs["bob"] = finished_job(s, bob, "bobs-secret-job")
        for i, (lr, bs) in enumerate([(0.1, 64), (0.01, 64), (0.01, 32)]):
            spec = {**SPEC, "optimizer": {"name": "sgd", "lr": lr}, "batch_size": bs}
            jid = finished_job(s, alice, f"cmp-{i}", spec)
            ingest_metrics(s, jid, [{"name": "val/accuracy", "step": k, "value": 0.5 + 0.1 * i + k / 1000, "time": 0.0} for k in range(0, 300, 10)])  # fmt: skip
            w.jobs[f"cmp-{i}"] = jid
        xss_spec = {**SPEC, "data": {"name": "digits", "note": XSS}}
        jid = finished_job(s, alice, "x" + XSS, xss_spec)
        ingest_metrics(s, jid, [{"name": f"train/{XSS}", "step": k, "value": 1.0 / (k + 1), "time": 0.0} for k in range(20)])  # fmt: skip
        w.jobs["xss"] = jid
    log = job_dir(w.c.storage, w.jobs["xss"]) / LOG_FILE
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"epoch 1\n{XSS}\nlast line\n")


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    url = None
    if request.param == "postgres":  # a fresh database on the shared server, dropped after
        from worker_factories import drop_pg_databases, new_pg_database

        make = new_pg_database(request.getfixturevalue("pg_url"))
        request.addfinalizer(lambda: drop_pg_databases(make))
        url = make()
    c = Cluster(tmp_path_factory.mktemp(f"dashboard-{request.param}"), database_url=url)
    try:
        start_api(c)
        w = World(c)
        _seed(w)
        yield w
    finally:
        c.stop()


def _no_secrets_kept(page: Any) -> None:
    """Nothing the page keeps holds a token or a login secret, and the session cookie is
    out of the page's reach."""
    kept = page.evaluate(
        "() => JSON.stringify([localStorage, sessionStorage, location.href, document.cookie])"
    )
    assert "ty_" not in kept and "tyl_" not in kept and "tys_" not in kept, kept
    cookies = page.context.cookies()
    assert [c["name"] for c in cookies] == ["ty_session"]
    assert cookies[0]["httpOnly"] and cookies[0]["sameSite"] == "Strict"


def test_login_with_a_token_and_log_out(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    page.goto(world.base + "/jobs/" + world.jobs["million"])
    page.wait_for_url("**/login")
    shot(page, "login")
    page.fill("#token", "ty_wrong")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error:not([hidden])")
    assert "unknown or revoked" in page.inner_text("#login-error")
    assert page.input_value("#token") == ""  # never left in the form
    page.fill("#token", world.alice)
    page.click("button[type=submit]")
    page.wait_for_selector("#job-name")  # back where it was going
    assert page.inner_text("#job-name") == "million-steps"
    _no_secrets_kept(page)
    page.reload()
    page.wait_for_selector("#job-name")  # the session survives a reload
    page.click("text=Log out")
    page.wait_for_selector("#token")
    page.goto(world.base + "/")
    page.wait_for_selector("#token")


def test_login_through_the_one_time_url(
    world: World, new_page: Callable[[], Any], tmp_path: Path
) -> None:
    seen = tmp_path / "opened"
    browser_cmd = tmp_path / "browser.sh"
    browser_cmd.write_text(f'#!/bin/sh\nprintf %s "$1" > {seen}\n')
    browser_cmd.chmod(0o755)
    env = {**os.environ, "TORCHYARD_URL": world.base, "TORCHYARD_TOKEN": world.alice,
           "BROWSER": f"{browser_cmd} %s", "TORCHYARD_CONFIG": str(tmp_path / "none.json")}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "torchyard", "ui"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url.startswith(world.base + "/#login=tyl_")
    # Opened with the BROWSER given, through a page only this user can read: the secret
    # never goes onto the browser's command line (client/ui_cmd.py).
    opened = seen.read_text()
    assert opened.startswith("file://") and "tyl_" not in opened
    redirect = Path(unquote(urlparse(opened).path))
    assert f"url={url}" in redirect.read_text() and redirect.stat().st_mode & 0o077 == 0
    page = new_page()
    page.goto(url)
    page.wait_for_selector("#jobs-table tbody tr")
    assert page.get_attribute("body", "data-user") == "alice"
    assert page.url == world.base + "/"  # the secret left the address bar (and history)
    _no_secrets_kept(page)
    again = new_page()  # a second use of the link is refused
    again.goto(url)
    again.wait_for_selector("#login-error:not([hidden])")
    assert "expired or was already used" in again.inner_text("#login-error")


def test_table_updates_live_and_filters(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice)
    page.wait_for_selector("#live:text('live')")
    shot(page, "jobs")
    page.evaluate("() => { window.__same_page = 1 }")
    alice = world.as_user(world.alice)
    r = alice.post("/v1/jobs", json={**SPEC, "name": "live-one"})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    row = f"#jobs-table tr[data-id='{job}']"
    page.wait_for_selector(f"{row}[data-state='queued']", timeout=10_000)
    assert alice.post(f"/v1/jobs/{job}/cancel").status_code == 202
    page.wait_for_selector(f"{row}[data-state='cancelled']", timeout=10_000)
    assert page.evaluate("() => window.__same_page") == 1  # updated without a reload
    # Filters: by state (chips) and by text.
    page.click(".chip[data-state='cancelled']")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#jobs-table tbody tr')].every(r => r.dataset.state === 'cancelled')"
    )
    page.click(".chip[data-state='all']")
    page.fill("#job-filter", "cmp-")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 3")
    assert "state=" not in page.url and "q=cmp-" in page.url
    # bob's job is not in alice's table, and its page is a 404 for her too
    page.fill("#job-filter", "bobs")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 0")
    page.goto(world.base + "/jobs/" + world.jobs["bob"])
    page.wait_for_selector("text=Job not found")


def _spike_pixels(page: Any) -> dict[str, Any]:
    """Where the spike is drawn on the chart's canvas, and whether the pixels there are
    painted (band or line), not background."""
    return page.evaluate(
        """() => {
        const u = document.querySelector('.chart[data-group="loss"]').__chart.u;
        const maxs = u.data[3];
        let k = -1;
        for (let i = 0; i < maxs.length; i++) if (maxs[i] != null && (k < 0 || maxs[i] > maxs[k])) k = i;
        const x = Math.round(u.valToPos(u.data[0][k], 'x', true));
        const y = Math.round(u.valToPos(maxs[k], 'y', true));
        const ctx = u.ctx;
        let painted = 0;
        for (let dx = -2; dx <= 2; dx++) for (let dy = 0; dy <= 4; dy++) {
            const [r, g, b, a] = ctx.getImageData(x + dx, y + dy, 1, 1).data;
            if (a > 0 && !(r > 245 && g > 245 && b > 245)) painted++;
        }
        return {step: u.data[0][k], max: maxs[k], yMax: u.scales.y.max, painted, points: u.data[0].length,
                inside: y >= u.bbox.top && y <= u.bbox.top + u.bbox.height};
    }"""
    )


def test_chart_band_keeps_the_spike_and_zoom_loads_finer_points(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice)
    requests: list[str] = []
    page.on("request", lambda r: "/metrics" in r.url and requests.append(r.url))
    page.goto(world.base + "/jobs/" + world.jobs["million"])
    chart = ".chart[data-group='loss'][data-ready='1']"
    page.wait_for_selector(chart)
    over = _spike_pixels(page)
    # 1M points in at most one bucket per pixel column, and the 100x spike still drawn.
    spike = loss_curve(N, SPIKE_AT)[SPIKE_AT]
    assert over["points"] <= 4000 and over["max"] == spike and over["yMax"] >= spike
    assert 0 <= over["step"] - SPIKE_AT < 2 * N // over["points"]  # the spike's bucket
    assert over["inside"] and over["painted"] >= 3, over
    shot(page, "million-point-job")
    # Drag around the spike: the server sends that range's finer points.
    box = page.locator(f"{chart} .u-over").bounding_box()
    x_of = lambda step: box["x"] + box["width"] * step / N  # noqa: E731
    page.mouse.move(x_of(SPIKE_AT - 40_000), box["y"] + 40)
    page.mouse.down()
    page.mouse.move(x_of(SPIKE_AT + 40_000), box["y"] + 60, steps=6)
    page.mouse.up()
    page.wait_for_selector(".chart[data-group='loss'][data-mode='zoom']")
    lo, hi = map(int, page.get_attribute(".chart[data-group='loss']", "data-range").split("-"))
    assert lo < SPIKE_AT < hi and hi - lo < 120_000
    assert any(f"min_step={lo}" in u and f"max_step={hi}" in u for u in requests), requests
    zoom = _spike_pixels(page)
    assert zoom["step"] == SPIKE_AT or (hi - lo) / zoom["points"] > 1  # finer, spike kept
    assert (hi - lo) / zoom["points"] < N / over["points"] / 5, (zoom, over)
    assert zoom["max"] == pytest.approx(over["max"]) and zoom["painted"] >= 3, zoom
    # Double-click: back to the whole run.
    page.dblclick(f"{chart} .u-over")
    page.wait_for_selector(".chart[data-group='loss'][data-mode='overview']")
    assert _spike_pixels(page)["points"] == over["points"]
    page.check(".chart[data-group='loss'] input[type=checkbox]")
    assert (
        page.evaluate(
            "() => document.querySelector('.chart[data-group=\"loss\"]').__chart.u.scales.y.distr"
        )
        == 3
    )


def test_compare_overlays_runs_named_by_their_differences(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/?q=cmp-")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 3")
    # Locators, not element handles: a live update may redraw the rows between
    # two clicks, and the redrawn boxes keep the selection.
    boxes = page.locator("#jobs-table tbody input[type=checkbox]")
    for i in range(3):
        boxes.nth(i).check()
    page.wait_for_selector("#compare:not([disabled])")
    assert page.text_content("#compare") == "Compare (3)"
    page.click("#compare")
    page.wait_for_selector("#compare-chart[data-ready='1']")
    labels = page.eval_on_selector_all(".legend-label", "els => els.map(e => e.textContent)")
    assert sorted(labels) == [
        "cmp-0 · batch_size=64, optimizer.lr=0.1",
        "cmp-1 · batch_size=64, optimizer.lr=0.01",
        "cmp-2 · batch_size=32, optimizer.lr=0.01",
    ]
    sources = page.evaluate(
        "() => document.querySelector('#compare-chart').__chart.sources.map(s => s.job)"
    )
    assert sorted(sources) == sorted(world.jobs[f"cmp-{i}"] for i in range(3))
    assert page.input_value("#metric") == "val/accuracy"
    shot(page, "compare")


def test_submit_shows_the_servers_problems_field_by_field(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/submit")
    page.wait_for_selector("#spec-text")
    bad = "name: bad\nmodel: {name: mlp, hidden: [0]}\ndata:\n  name: digits\noptimizer:\n  name: sgd\n  lr: -1\nbatch_size: 0\n"  # fmt: skip
    page.fill("#spec-text", bad)
    page.click("#submit")
    page.wait_for_selector("#problems li")
    found = page.eval_on_selector_all(
        "#problems li", "els => els.map(e => [e.dataset.field, e.dataset.line])"
    )
    assert sorted(found) == [["batch_size", "8"], ["model.hidden.0", "2"], ["optimizer.lr", "7"]]
    bad_lines = page.eval_on_selector_all(".gutter .ln.bad", "els => els.map(e => e.textContent)")
    assert sorted(bad_lines) == ["2", "7", "8"]
    notes = page.eval_on_selector_all(
        ".note", "els => els.map(e => [e.dataset.line, e.textContent])"
    )
    assert ["7", "optimizer.lr: must be > 0.0"] in notes
    shot(page, "submit")
    page.fill("#spec-text", '{"name": "from-the-page", "model": {"name": "mlp"}, "data": {"name": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1}}')  # fmt: skip
    page.click("#submit")
    page.wait_for_selector("#job-name:text('from-the-page')")
    assert page.inner_text("#job-state") == "queued"


def test_cancel_asks_first(world: World, new_page: Callable[[], Any]) -> None:
    job = (
        world.as_user(world.alice).post("/v1/jobs", json={**SPEC, "name": "to-cancel"}).json()["id"]
    )
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job}")
    page.click("#cancel")
    page.click("#keep-running")
    time.sleep(0.3)
    assert world.c.get(f"/v1/jobs/{job}")["state"] == "queued"
    page.click("#cancel")
    page.click("#confirm")
    page.wait_for_selector("#job-state .state-cancelled")
    assert world.c.get(f"/v1/jobs/{job}")["state"] == "cancelled"
    assert page.query_selector("#cancel") is None


def test_xss_payloads_render_as_text(world: World, new_page: Callable[[], Any]) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/?q=%3Cimg")
    job = world.jobs["xss"]

    def no_markup() -> None:
        assert page.query_selector("img[src=x]") is None
        assert page.evaluate("() => [...document.scripts].every(s => s.src)")
        assert page.evaluate("() => window.__xss") is None

    page.wait_for_selector(f"#jobs-table tr[data-id='{job}']")
    assert XSS in page.inner_text(f"#jobs-table tr[data-id='{job}'] td.name")
    no_markup()
    page.click(f"#jobs-table tr[data-id='{job}'] a")
    page.wait_for_selector(".chart[data-ready='1']")
    page.wait_for_function("() => document.querySelector('#log').textContent.includes('last line')")
    assert page.inner_text("#job-name") == "x" + XSS
    assert XSS in page.inner_text("#log")  # a log line
    assert XSS in page.inner_text("#spec")  # the spec's contents
    assert f"train/{XSS}" in page.inner_text(".legend")  # a metric name
    assert page.inner_text(".chart h3") == XSS  # the chart of the group it names
    no_markup()
    page.goto(f"{world.base}/compare?jobs={job},{world.jobs['cmp-0']}")
    page.wait_for_selector("#runs")
    assert XSS in page.inner_text("#runs")
    no_markup()


def test_ten_thousand_jobs(world: World, new_page: Callable[[], Any]) -> None:
    page = new_page()
    page.goto(world.base + "/login")
    page.fill("#token", world.carol)
    started = time.monotonic()
    page.click("button[type=submit]")
    page.wait_for_selector("#jobs-table tbody tr")
    first_table_s = time.monotonic() - started
    assert page.inner_text("#range") == "1\u2013100 of 10000"
    assert page.eval_on_selector_all("#jobs-table tbody tr", "r => r.length") == 100
    page.click("#next")
    page.wait_for_selector("#range:text('101\u2013200 of 10000')")
    page.fill("#job-filter", "bulk-4242")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 1")
    assert first_table_s < 5, first_table_s
