"""The dashboard watching real training: an API, a scheduler and a CPU worker as their own
processes; the page follows a running job (curves and log, live through its event
stream), cancels it, and downloads a finished job's checkpoint with its sha256."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import login, token_for
from worker_cluster import Cluster, wait_for

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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("dashboard-live"))
    try:
        yield c.start(workers=1)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def alice(cluster: Cluster) -> str:
    return token_for(cluster, "alice")


def _submit(c: Cluster, token: str, spec: dict[str, Any]) -> str:
    r = c.http.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _points(page: Any) -> int:
    return int(page.get_attribute(".chart[data-group='loss']", "data-points") or 0)


def test_follows_a_running_job_then_cancels_it(
    cluster: Cluster, alice: str, new_page: Callable[[], Any]
) -> None:
    job = _submit(cluster, alice, LONG)
    page = new_page()
    metric_requests: list[str] = []
    page.on("request", lambda r: "/metrics" in r.url and metric_requests.append(r.url))
    login(page, cluster.url, alice, f"/jobs/{job}")
    page.wait_for_selector("#job-state .state-running", timeout=60_000)
    page.wait_for_selector(".chart[data-group='loss'][data-ready='1']", timeout=30_000)
    page.evaluate("() => { window.__same_page = 1 }")
    before = _points(page)
    # New points arrive through the stream and are drawn as they come (appended, not
    # queried: a new curve, val/loss at the first epoch's end, is the only reload).
    page.wait_for_function(
        "() => { const c = document.querySelector('.chart[data-group=\"loss\"]');"
        f" return c.__chart.appended > 10 && +c.dataset.points > {before}; }}",
        timeout=30_000,
    )
    assert all("max_points=" in u for u in metric_requests)  # never the raw history
    page.wait_for_function("() => document.querySelector('#log').textContent.length > 0")
    assert page.evaluate("() => window.__same_page") == 1
    progress = page.inner_text(".info .progress")
    assert "/40000" in progress and "ETA" in progress  # 400 epochs of 100 steps
    page.wait_for_function(  # and it moves, live
        f"() => document.querySelector('.info .progress').textContent !== {progress!r}"
    )
    page.click("#cancel")
    page.click("#confirm")
    page.wait_for_selector("#job-state .state-cancelled", timeout=60_000)
    attempts = page.inner_text("#attempts")
    assert "cancelled" in attempts
    assert cluster.job(job)["state"] == "cancelled"


def test_checkpoint_download_and_workers(
    cluster: Cluster, alice: str, new_page: Callable[[], Any], tmp_path: Path
) -> None:
    job = _submit(cluster, alice, SHORT)
    cluster.wait_state(job, "succeeded", timeout=120)
    page = new_page()
    login(page, cluster.url, alice, f"/jobs/{job}")
    page.wait_for_selector("#checkpoints")
    row = page.locator("#checkpoints tbody tr", has_text="weights")
    sha = row.locator("td.sha").inner_text().strip()
    assert len(sha) == 64
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
