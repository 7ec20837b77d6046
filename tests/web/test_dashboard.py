"""The dashboard in a real browser against a real API process (no workers: jobs are put
where each test needs them, and curves are written straight into the store), on SQLite and
on PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, finished_job, long_curve_job, loss_curve, many_jobs, user_id
from support.worker_cluster import ROOT, Cluster

from torchyard.store.jobs import create_job
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Attempt, Job
from torchyard.store.paths import LOG_FILE, job_dir

pytestmark = pytest.mark.browser

N = 1_000_000
PALETTE_RUNS = 13
QUEUE_REASON = "quota: alice uses 4 of her max_workers 4"
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


def _seed(w: World) -> World:
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
    _seed_rough_edges(w)
    log = job_dir(w.c.storage, w.jobs["xss"]) / LOG_FILE
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"epoch 1\n{XSS}\nlast line\n")
    return w


def _seed_rough_edges(w: World) -> None:
    """What issue 27's tests look at: a run of five steps with values next to 1; runs to
    compare that differ in a code bundle (a sha256) and in lr values like 0.30000000000000004;
    queued jobs, with and without the scheduler's reason."""
    with w.c.session() as s:
        alice = user_id(s, "alice")
        jid = finished_job(s, alice, "few-steps")
        acc, loss = [0.9999, 0.99994, 0.99997, 0.99999, 1.0], [0.62, 0.55, 0.5, 0.47, 0.45]
        ingest_metrics(s, jid, [{"name": "val/accuracy", "step": k, "value": v, "time": 0.0} for k, v in enumerate(acc)])  # fmt: skip
        ingest_metrics(s, jid, [{"name": "train/loss", "step": k, "value": v, "time": 0.0} for k, v in enumerate(loss)])  # fmt: skip
        w.jobs["few"] = jid
        for i in range(PALETTE_RUNS):
            spec = {**SPEC, "optimizer": {"name": "sgd", "lr": (i + 1) * 0.1},
                    "code": {"bundle": hashlib.sha256(b"bundle %d" % i).hexdigest()}}  # fmt: skip
            name = f"pal-{i}" + ("-" + "a-very-long-run-name" * 8 if i == 0 else "")
            jid = finished_job(s, alice, name, spec)
            ingest_metrics(s, jid, [{"name": "val/accuracy", "step": k, "value": 0.5 + 0.03 * i + k / 1000, "time": 0.0} for k in range(0, 30, 10)])  # fmt: skip
            w.jobs[f"pal-{i}"] = jid
        for name, reason in [("queued-why", QUEUE_REASON), ("queued-new", None)]:
            job, _ = create_job(s, alice, {**SPEC, "name": name}, name=name)
            job.pending_reason = reason
            w.jobs[name] = job.id
        # Its first attempt handed back (its worker stopped), the second ran to the end.
        jid = finished_job(s, alice, "handed-back")
        job = s.get(Job, jid)
        assert job is not None
        job.attempt = 2
        s.add_all([Attempt(job_id=jid, number=1, state="handed_back", reason="worker w0 stopped"),
                   Attempt(job_id=jid, number=2, state="succeeded")])  # fmt: skip
        w.jobs["handed-back"] = jid


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "dashboard", lambda c: _seed(World(c)))


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
    page.wait_for_selector("#jobs-table tbody tr")  # the picture shows rows
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
    page.wait_for_selector("#no-jobs")  # an empty result says so, in the one row it shows
    assert page.inner_text("#no-jobs") == "No jobs match these filters."
    assert page.eval_on_selector_all("#jobs-table tbody tr", "rs => rs.length") == 1
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
    checked = page.eval_on_selector_all("#metrics input:checked", "els => els.map(e => e.dataset.metric)")  # fmt: skip
    assert checked == ["val/accuracy"]  # the default: one chart
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
    tips = page.eval_on_selector_all(
        ".gutter .ln.bad", "els => els.map(e => [e.textContent, e.title])"
    )
    assert ["7", "optimizer.lr: must be > 0.0"] in tips
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


# ---- issue 27: the dashboard's rough edges ------------------------------------------------

_AXES = """(group) => {
    const u = document.querySelector(`.chart[data-group="${group}"]`).__chart.u;
    const [x, y] = u.axes;
    return {distr: u.scales.y.distr, xSplits: x._splits, xLabels: x._values, ySplits: y._splits,
            yLabels: y._values};
}"""
_AXES_READY = """(group) => {
    const c = document.querySelector(`.chart[data-group="${group}"][data-ready="1"]`);
    const u = c && c.__chart.u;
    return !!(u && u.axes[1]._values && u.axes[0]._values);
}"""


def _number(label: str) -> float:
    return float(label.replace(",", "").replace("\u2212", "-"))


def _open_chart(page: Any, base: str, token: str, job: str, group: str) -> None:
    login(page, base, token, "/jobs/" + job)
    page.wait_for_function(_AXES_READY, arg=group)


def test_chart_steps_are_whole_and_tick_labels_differ(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    _open_chart(page, world.base, world.alice, world.jobs["few"], "accuracy")
    acc = page.evaluate(_AXES, "accuracy")
    # Five steps: the x ticks are steps (whole numbers), never 0.5, 1.5, …
    assert acc["xSplits"] and all(float(v).is_integer() for v in acc["xSplits"]), acc
    assert all(_number(v).is_integer() for v in acc["xLabels"] if v), acc
    # Values between 0.9999 and 1: as many decimals as tell the ticks apart.
    ys = [v for v in acc["yLabels"] if v]
    assert len(ys) >= 3 and len(set(ys)) == len(ys), acc
    for split, label in zip(acc["ySplits"], acc["yLabels"], strict=True):
        assert _number(label) == pytest.approx(split, abs=1e-9), acc
    shot(page, "few-steps")


def test_log_scale_axis_has_numbers_at_its_ticks(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    _open_chart(page, world.base, world.alice, world.jobs["few"], "loss")
    page.check(".chart[data-group='loss'] input[type=checkbox]")
    page.wait_for_function(
        "() => document.querySelector('.chart[data-group=\"loss\"]').__chart.u.scales.y.distr === 3"
    )
    page.wait_for_function(_AXES_READY, arg="loss")
    log = page.evaluate(_AXES, "loss")
    # Numbers (not only at whole decades, and no dashes), none repeated.
    shown = [v for v in log["yLabels"] if v]
    assert all(re.fullmatch(r"[0-9.,e-]+", v) for v in shown), log
    assert len(shown) >= 3 and len(set(shown)) == len(shown), log
    for split, label in zip(log["ySplits"], log["yLabels"], strict=True):
        assert not label or _number(label) == pytest.approx(split), log
    shot(page, "few-steps-log")


def _compare_many(world: World, new_page: Callable[[], Any]) -> Any:
    ids = [world.jobs[f"pal-{i}"] for i in range(PALETTE_RUNS)]
    page = new_page()
    login(page, world.base, world.alice, "/compare?jobs=" + ",".join(ids))
    page.wait_for_selector("#compare-chart[data-ready='1']")
    return page


def test_compare_legend_names_runs_by_short_differences(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = _compare_many(world, new_page)
    items = page.eval_on_selector_all(
        "#compare-chart .legend-item",
        """els => els.map(e => {
            const l = e.querySelector('.legend-label');
            return {text: l.textContent, title: e.title, height: l.getBoundingClientRect().height,
                    lineHeight: parseFloat(getComputedStyle(l).lineHeight) || 16,
                    cut: l.scrollWidth > l.clientWidth};
        })""",
    )
    assert len(items) == PALETTE_RUNS
    shas = [hashlib.sha256(b"bundle %d" % i).hexdigest() for i in range(PALETTE_RUNS)]
    for i, item in enumerate(items):
        # Only what differs, short: the bundle's first 8 characters, lr to 4 digits at most.
        assert not re.search(r"[0-9a-f]{9,}", item["text"]), item
        assert f"code.bundle={shas[i][:8]}" in item["text"], item
        assert not re.search(r"\d\.\d{5,}", item["text"]), item
        assert "batch_size" not in item["text"] and "data.name" not in item["text"], item
        assert shas[i] in item["title"], item  # the whole of it in the tooltip
        assert item["height"] <= 1.5 * item["lineHeight"], item  # one line, never three
    assert items[2]["text"].endswith("optimizer.lr=0.3"), items[2]
    assert "0.30000000000000004" in items[2]["title"]
    assert items[0]["cut"] and "a-very-long-run-name" * 8 in items[0]["title"]
    assert not re.search(r"[0-9a-f]{9,}", page.inner_text("#runs tbody"))
    shot(page, "compare-many")


def test_compare_colours_do_not_repeat_for_twelve_runs(
    world: World, new_page: Callable[[], Any]
) -> None:
    page = _compare_many(world, new_page)
    styles = page.evaluate(
        """() => { const c = document.querySelector('#compare-chart').__chart;
            return c.sources.map((s, i) => [c.u.series[1 + 3 * i].stroke(c.u, 1 + 3 * i),
                                            JSON.stringify(c.u.series[1 + 3 * i].dash || null)]); }"""
    )
    # Twelve colours before any repeats; the thirteenth curve is told apart by its dash.
    assert len({c for c, _ in styles[:12]}) == 12, styles
    assert len(set(map(tuple, styles))) == PALETTE_RUNS, styles
    swatches = page.eval_on_selector_all(
        "#compare-chart .legend-item .swatch", "els => els.map(e => e.style.background)"
    )
    assert len(set(swatches)) == PALETTE_RUNS, swatches  # the legend shows the dash too


def test_queued_job_says_why_it_waits(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/?q=queued-")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 2")
    why = f"#jobs-table tr[data-id='{world.jobs['queued-why']}']"
    assert QUEUE_REASON in page.inner_text(f"{why} td:nth-child(4)")  # progress: the reason
    shot(page, "queued-table")
    page.goto(world.base + "/jobs/" + world.jobs["queued-why"])
    page.wait_for_selector("#pending")
    assert page.inner_text("#pending") == QUEUE_REASON
    info = page.eval_on_selector_all(".info dd", "els => els.map(e => e.textContent)")
    assert "waiting" not in info, info  # the reason, not a bare "waiting"
    shot(page, "queued-job")
    page.goto(world.base + "/jobs/" + world.jobs["queued-new"])  # no reason given yet
    page.wait_for_selector("#pending-none")
    assert "scheduler" in page.inner_text("#pending-none")
    info = page.eval_on_selector_all(".info dd", "els => els.map(e => e.textContent)")
    assert "waiting" not in info, info


_HINT_ROOM = """() => { const el = document.querySelector('#job-filter'), cs = getComputedStyle(el);
    const ctx = document.createElement('canvas').getContext('2d'); ctx.font = cs.font;
    return [ctx.measureText(el.placeholder).width,
            el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight)]; }"""


def test_filter_hint_fits_and_an_empty_table_says_so(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    """The filter's placeholder is shown whole (an admin's, the longer, too); a user with
    no job reads "No jobs yet." where the rows would be."""
    admin = new_page()
    login(admin, world.base, world.c.token)
    admin.wait_for_selector("#jobs-table tbody tr[data-id]")
    need, room = admin.evaluate(_HINT_ROOM)
    assert admin.get_attribute("#job-filter", "placeholder") == "filter by name or id or owner"
    assert need <= room, (need, room)
    shot(admin, "jobs-filter-hint-admin")
    page = new_page()
    login(page, world.base, token_for(world.c, "dave"))
    page.wait_for_selector("#no-jobs")
    assert page.inner_text("#no-jobs") == "No jobs yet."
    need, room = page.evaluate(_HINT_ROOM)
    assert need <= room, (need, room)
    shot(page, "jobs-none-yet")


def test_a_hand_back_is_not_counted_in_the_attempt_line(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    """Attempt 2 after a hand-back has used none of its restarts (store/lifecycle.py counts
    failed and lost attempts only): the line says so, not a bare "(max restarts 2)"."""
    job = world.as_user(world.alice).get(f"/v1/jobs/{world.jobs['handed-back']}").json()
    assert [a["state"] for a in job["attempts"]] == ["handed_back", "succeeded"]
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{job['id']}")
    line = page.wait_for_selector("#attempt-line")
    want = f"2 (1 hand-back, not counted; restarts used 0 of {job['max_restarts']})"
    assert line.text_content() == want
    shot(page, "handed-back-job")
    page.goto(f"{world.base}/jobs/{world.jobs['few']}")  # one attempt, none handed back
    page.wait_for_selector("#attempt-line")
    assert page.inner_text("#attempt-line") == f"1 (restarts used 0 of {job['max_restarts']})"


def test_world_size_is_explained(world: World, new_page: Callable[[], Any]) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/?q=cmp-")
    page.wait_for_function("() => document.querySelectorAll('#jobs-table tbody tr').length === 3")
    cell = f"#jobs-table tr[data-id='{world.jobs['cmp-0']}'] td:nth-child(7)"
    assert page.inner_text(cell) == "1 worker"  # not "\u00d71"
    title = page.eval_on_selector(cell, "td => td.querySelector('[title]')?.title || td.title")
    assert "world_size 1" in title and "rank" in title, title
    assert "\u00d7" not in page.inner_text("#jobs-table tbody")
    page.goto(world.base + "/jobs/" + world.jobs["cmp-0"])
    page.wait_for_selector(".info dd span.workers")
    assert page.inner_text(".info dd span.workers") == "1 worker"
    assert "rank" in page.get_attribute(".info dd span.workers", "title")


def test_submit_lists_each_problem_once(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/submit")
    page.wait_for_selector("#spec-text")
    page.fill("#spec-text", "name: a\nname: b\n")  # not even YAML's rules
    page.click("#submit")
    page.wait_for_selector("#problems li")
    found = page.eval_on_selector_all(
        "#problems li",
        "els => els.map(e => [e.dataset.line, e.querySelector('.message').textContent])",
    )
    assert found == [["2", "Map keys must be unique"]]  # no position left dangling after it
    assert page.inner_text("main").count("Map keys must be unique") == 1
    shot(page, "submit-yaml-error")
    page.fill("#spec-text", "name: bad\noptimizer:\n  name: sgd\n  lr: -1\nbatch_size: 0\n")
    page.click("#submit")
    page.wait_for_selector("#problems li[data-field='optimizer.lr']")
    text = page.inner_text("main")
    assert text.count("must be > 0.0") == 1 and text.count("must be >= 1") == 1, text
