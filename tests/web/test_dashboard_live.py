"""The dashboard watching real training: an API, a scheduler and a CPU worker as their own
processes, on the embedded defaults and on PostgreSQL + Redis; the page follows a running
job (curves, log and pending reason, live through its event stream, with no timer),
compares runs while they train, cancels a job, and downloads a finished job's checkpoint
with its sha256."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import login, token_for
from support.worker_cluster import EMBEDDED, Cluster, backend_cluster, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

LONG: dict[str, Any] = {
    "name": "live-run",
    "model": {"name": "mlp", "hidden": [256]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 4000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 400,
    "log_every_steps": 2,
    "checkpoint": {"every_steps": 100, "every_epochs": None, "keep_last": 2},
    "seed": 1,
}
SHORT: dict[str, Any] = {
    "name": "short-run",
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "batch_size": 64,
    "epochs": 2,
    "log_every_steps": 5,
    "seed": 3,
}


@pytest.fixture(scope="module", params=[EMBEDDED])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    yield from backend_cluster(request, tmp_path_factory, workers=1)


@pytest.fixture(scope="module")
def alice(cluster: Cluster) -> str:
    return token_for(cluster, "alice")


def _submit(c: Cluster, token: str, spec: dict[str, Any]) -> str:
    r = c.http.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _points(page: Any) -> int:
    return int(page.get_attribute(".chart[data-group='loss']", "data-points") or 0)


def _canvas(page: Any) -> dict[str, int]:
    """The loss chart's plot area as drawn: how many pixels are painted (not background)
    and a hash of all of them."""
    return page.evaluate(
        """() => {
        const u = document.querySelector('.chart[data-group="loss"]').__chart.u;
        const {left, top, width, height} = u.bbox;
        const px = u.ctx.getImageData(left, top, width, height).data;
        let painted = 0, hash = 0;
        for (let i = 0; i < px.length; i += 4) {
            if (px[i + 3] > 0 && !(px[i] > 245 && px[i + 1] > 245 && px[i + 2] > 245)) painted++;
            hash = (Math.imul(hash, 31) + px[i] + 7 * px[i + 1] + 13 * px[i + 2] + 17 * px[i + 3]) | 0;
        }
        return {painted, hash};
    }"""
    )


def test_follows_a_running_job_then_cancels_it(
    cluster: Cluster, alice: str, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    job = _submit(cluster, alice, LONG)
    page = new_page()
    metric_requests: list[str] = []
    page.on("request", lambda r: "/metrics" in r.url and metric_requests.append(r.url))
    login(page, cluster.url, alice, f"/jobs/{job}")
    page.wait_for_selector("#job-state .state-running", timeout=60_000)
    page.wait_for_selector(".chart[data-group='loss'][data-ready='1']", timeout=30_000)
    page.evaluate("() => { window.__same_page = 1 }")
    before, pixels = _points(page), _canvas(page)
    # New points arrive through the stream and are drawn as they come (appended, not
    # queried: a new curve, val/loss at the first epoch's end, is the only reload).
    page.wait_for_function(
        "() => { const c = document.querySelector('.chart[data-group=\"loss\"]');"
        f" return c.__chart.appended > 10 && +c.dataset.points > {before}; }}",
        timeout=30_000,
    )
    assert all("max_points=" in u for u in metric_requests)  # never the raw history
    later = _canvas(page)  # the curve visibly moved: other pixels painted than before
    assert later["painted"] > 0 and later["hash"] != pixels["hash"]
    page.wait_for_function("() => document.querySelector('#log').textContent.length > 0")
    shown = page.evaluate("() => document.querySelector('#log').textContent.length")
    page.wait_for_function(  # the log follows the trainer (told by the stream's status)
        f"() => document.querySelector('#log').textContent.length > {shown}", timeout=30_000
    )
    assert page.evaluate("() => window.__same_page") == 1
    progress = page.inner_text(".info .progress")
    assert "/40000" in progress and "ETA" in progress  # 400 epochs of 100 steps
    page.wait_for_function(  # and it moves, live
        f"() => document.querySelector('.info .progress').textContent !== {progress!r}"
    )
    shot(page, "running-job")
    page.click("#cancel")
    page.click("#confirm")
    page.wait_for_selector("#job-state .state-cancelled", timeout=60_000)
    attempts = page.inner_text("#attempts")
    assert "cancelled" in attempts
    assert cluster.job(job)["state"] == "cancelled"


def test_pending_reason_and_compare_follow_the_stream_without_polling(
    cluster: Cluster, alice: str, new_page: Callable[[], Any]
) -> None:
    admin = {"Authorization": f"Bearer {cluster.token}"}
    running = _submit(cluster, alice, LONG | {"name": "busy-run"})
    cluster.wait_state(running, "running", timeout=60)
    queued = _submit(cluster, alice, SHORT | {"name": "waiting-run"})  # the one worker is busy
    try:
        page = new_page()
        # The page opens its event stream once its first reads (job, checkpoints, log)
        # are done: only what it reads after that counts.
        events = f"/v1/jobs/{queued}/events"
        with page.expect_request(lambda r: r.url.split("?")[0].endswith(events)):
            login(page, cluster.url, alice, f"/jobs/{queued}")
        page.wait_for_selector("#pending")
        assert "quota" not in page.inner_text("#pending")
        reads: list[str] = []
        page.on("request", lambda r: f"/v1/jobs/{queued}" in r.url and reads.append(r.url))
        page.wait_for_timeout(4000)  # nothing changes: nothing is read
        assert [u for u in reads if not u.split("?")[0].endswith("/events")] == []
        r = cluster.http.put("/v1/users/alice/quota", json={"max_workers": 1}, headers=admin)
        assert r.status_code == 200, r.text
        page.wait_for_function(
            "() => (document.querySelector('#pending') || {}).textContent?.startsWith('quota:')",
            timeout=30_000,
        )
        # Compare a running job: its curve and row are re-read as it trains.
        cmp = new_page()
        login(cmp, cluster.url, alice, f"/compare?jobs={running}&metric=train/loss")
        cmp.wait_for_selector("#compare-chart[data-ready='1']")
        loads = int(cmp.get_attribute("#compare-chart", "data-loads") or 0)
        cmp.wait_for_function(
            f"() => +document.querySelector('#compare-chart').dataset.loads > {loads}",
            timeout=30_000,
        )
    finally:
        cluster.http.put("/v1/users/alice/quota", json={"max_workers": None}, headers=admin)
        for job in (running, queued):
            cluster.http.post(
                f"/v1/jobs/{job}/cancel", headers={"Authorization": f"Bearer {alice}"}
            )
        for job in (running, queued):
            cluster.wait_state(job, "cancelled", timeout=60)


def test_checkpoint_download_and_workers(
    cluster: Cluster,
    alice: str,
    new_page: Callable[[], Any],
    tmp_path: Path,
    shot: Callable[[Any, str], None],
) -> None:
    job = _submit(cluster, alice, SHORT)
    cluster.wait_state(job, "succeeded", timeout=120)
    page = new_page()
    login(page, cluster.url, alice, f"/jobs/{job}")
    page.wait_for_selector("#checkpoints")
    row = page.locator("#checkpoints tbody tr", has_text="weights")
    sha = row.locator("td.sha").inner_text().strip()
    assert len(sha) == 64
    # Its id, as `torchyard download --checkpoint id:N` takes it, is shown beside its step.
    listed = cluster.get(f"/v1/jobs/{job}/checkpoints")["items"]
    weights = next(c for c in listed if c["kind"] == "weights")
    assert row.locator("td.ckpt-id").inner_text().strip() == str(weights["id"])
    with page.expect_download() as dl:
        row.locator("a.download").click()
    saved = tmp_path / "weights.safetensors"
    dl.value.save_as(saved)
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == sha
    page.click("text=Workers")
    page.wait_for_selector("#workers tbody tr[data-id='w0']")
    wait_for(
        lambda: page.inner_text("#workers tbody tr[data-id='w0'] td.age").endswith("s ago"),
        10,
        "a heartbeat age",
    )
    assert "CPU" in page.inner_text("#workers tbody tr[data-id='w0']")
    shot(page, "workers")
