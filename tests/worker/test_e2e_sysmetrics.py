"""System metrics end to end, real processes (`torchyard api`, a scheduler, one CPU worker
on the embedded defaults, sampling every second): a script job inside the sandbox whose
subprocess holds 256 MiB for a few seconds. The job's `sys/rss_bytes` counts that
subprocess (the whole tree, not only the trainer), `sys/cpu_percent` stays within the
host's cores, both are indexed by whole Unix seconds and served by the metrics route, and
the job log says once why there are no GPU series."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.worker_cluster import Cluster, backend_cluster

from torchyard.client.sdk import Client

pytestmark = pytest.mark.e2e

MIB = 1024**2
HELD = 256 * MIB
SCRIPT = """
import os, subprocess, sys, time
from torchyard import job

job.setup()
own = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
hold = "import time; b = b'1' * (256 << 20); print('held', flush=True); time.sleep(4)"
child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE)
child.stdout.readline()
job.log(1, **{"test/own_rss": own})
child.wait()
time.sleep(1)
"""


@pytest.fixture(scope="module", params=["embedded"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    env = {"TORCHYARD_SYS_METRICS_INTERVAL_S": "1"}
    yield from backend_cluster(request, tmp_path_factory, workers=1, extra_env=env)


def test_a_jobs_process_tree_memory_and_cpu_by_the_second(cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "hold.py").write_text(SCRIPT)
    submitted = time.time()
    with Client(url=cluster.url, token=cluster.token) as sdk:
        job = sdk.submit({"entrypoint": {"script": "hold.py", "args": []}}, code=tmp_path)
    done = cluster.wait_state(job["id"], "succeeded", timeout=120)
    _, (own,) = cluster.metrics(job["id"], "test/own_rss")
    steps, rss = cluster.metrics(job["id"], "sys/rss_bytes")
    assert steps == sorted(set(steps)) and len(steps) >= 3
    assert int(submitted) <= steps[0] and steps[-1] <= time.time()
    # The subprocess's bytes are in the tree's; the bound leaves room for the sandbox's
    # processes and the subprocess's own interpreter, not for a second trainer.
    assert own + HELD <= max(rss) < own + HELD + 512 * MIB, (own, rss)
    cpu_steps, cpu = cluster.metrics(job["id"], "sys/cpu_percent")
    assert cpu_steps == steps
    assert all(0.0 <= v <= 100.0 * (os.cpu_count() or 1) for v in cpu) and max(cpu) > 0
    assert not any(n.startswith("sys/gpu") for n in done["latest_metrics"])
    assert cluster.job_log(job["id"]).count("no GPU series: this worker has no GPU") == 1
