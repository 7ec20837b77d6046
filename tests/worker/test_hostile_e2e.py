"""Issue 25, end to end with real processes (`torchyard api`, a scheduler, one CPU worker)
on the embedded defaults and on PostgreSQL + Redis: real script jobs that log 3,000
metric names in one flush, and one that saves 1.1 GiB into a run directory limited to
256 MiB. The worker never wedges: the jobs end, a cancel ends one within seconds, and the
worker runs the next job. The same attacks line by line: test_hostile_events.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.worker_cluster import REDIS_POSTGRES, Cluster, backend_cluster, wait_for

from torchyard.client.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.hostile]

SCRIPT = """
import sys, time
import torch
import torchyard.job as job

mode = sys.argv[1]
if mode == "names":  # 3,000 distinct names in one flush (the review's wedge)
    job.log(0, loss=1.0)
    job.log(1, **{f"m/{i:04d}": float(i) for i in range(3000)})
    job.log(2, loss=0.5)
elif mode == "names-then-wait":
    job.log(1, **{f"m/{i:04d}": float(i) for i in range(3000)})
    while not job.should_stop():
        time.sleep(0.05)
elif mode == "big-save":  # 1.1 GiB into a run directory limited to 256 MiB
    job.save({"w": torch.zeros(int(1.1 * 2**30) // 4)}, 1)
    time.sleep(30)
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile-bundle")
    (d / "hostile.py").write_text(SCRIPT)
    return d


@pytest.fixture(scope="module", params=[REDIS_POSTGRES])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    # No system metrics: their `sys/…` names count in the job's budget of names, and
    # whether a sample lands before the 3,000-name flush depends on the machine's load (the
    # count of names set aside was 2,003, not 2,001, in a loaded run).
    env = {
        "TORCHYARD_MAX_RUN_DIR_BYTES": str(256 * 1024**2),
        "TORCHYARD_SYS_METRICS_INTERVAL_S": "0",
    }
    yield from backend_cluster(request, tmp_path_factory, workers=1, extra_env=env)


@pytest.fixture(scope="module")
def sdk(cluster: Cluster) -> Iterator[Client]:
    with Client(url=cluster.url, token=cluster.token) as client:
        yield client


def _spec(mode: str) -> dict[str, Any]:
    return {"name": f"hostile-{mode}", "entrypoint": {"script": "hostile.py", "args": [mode]},
            "max_restarts": 0}  # fmt: skip


def test_3000_metric_names_in_one_flush_do_not_wedge_the_worker(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    job = sdk.submit(_spec("names"), code=bundle)
    done = cluster.wait_state(job["id"], "succeeded", timeout=120)
    (attempt,) = done["attempts"]
    # loss and 999 of the 3,000 make the job's 1,000 names; the other 2,001 are set aside
    assert "2001 event line(s) set aside" in (attempt["reason"] or ""), attempt
    assert "TORCHYARD_MAX_METRIC_NAMES" in cluster.job_log(job["id"])
    steps, values = cluster.metrics(job["id"], "loss")
    assert (steps, values) == ([0, 2], [1.0, 0.5])  # a known name goes on being recorded


def test_a_cancel_ends_such_a_job_within_seconds_and_the_worker_goes_on(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    job = sdk.submit(_spec("names-then-wait"), code=bundle)
    wait_for(lambda: "set aside" in cluster.job_log(job["id"]), 120, "the flush")
    t0 = time.monotonic()
    cluster.http.post(f"/v1/jobs/{job['id']}/cancel")
    cluster.wait_state(job["id"], "cancelled", timeout=10)
    assert time.monotonic() - t0 < 10
    nxt = sdk.submit(_spec("names"), code=bundle)
    cluster.wait_state(nxt["id"], "succeeded", timeout=120)


def test_a_1_1_gib_save_fails_as_run_dir_full(cluster: Cluster, sdk: Client, bundle: Path) -> None:
    job = sdk.submit(_spec("big-save"), code=bundle)
    done = cluster.wait_state(job["id"], "failed", timeout=120)
    assert done["error"].startswith("run_dir_full: "), done["error"]
    assert [a["state"] for a in done["attempts"]] == ["failed"]
    from torchyard.store.paths import job_dir

    for f in job_dir(cluster.storage, job["id"]).rglob("*"):  # 1.1 GiB: not kept by tests
        if f.is_file() and f.stat().st_size > 2**20:
            f.unlink()
