"""A hostile tenant's script job against a running pool (`torchyard api`, a scheduler, two
workers; embedded and PostgreSQL + Redis): it cannot read the admin token, the database,
another job's checkpoint or a worker's environment, cannot leave code that another job
imports, and its flood of output is cut at the log cap while it runs on.

Each attack here succeeded on the main of issue 25's review (a script ran with the worker's
rights and `TORCHYARD_HOME` in its environment, and bundles shared one unpacked folder)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.worker_cluster import EMBEDDED, Cluster, backend_cluster, wait_for

from torchyard.client.sdk import Client
from torchyard.worker.sandbox import support

pytestmark = [pytest.mark.e2e, pytest.mark.hostile]

if not support().ok and os.environ.get("CI") != "true":
    pytest.skip(f"this host cannot sandbox: {support().why}", allow_module_level=True)

PROBE = """
import json, os, sys
out = {"read": {}, "env": sorted(os.environ), "uid": os.getuid()}
for p in sys.argv[1:]:
    try:
        with open(p, "rb") as f:
            f.read(16)
        out["read"][p] = "READ"
    except OSError as e:
        out["read"][p] = type(e).__name__
try:  # before this job plants anything: what an earlier job may have left
    import planted  # noqa
    out["imported_planted"] = True
except ImportError:
    out["imported_planted"] = False
out["planted_in"] = []
for name in ("planted.py", "yaml.py"):
    for where in (".", os.path.dirname(os.path.abspath(__file__))):
        try:
            with open(os.path.join(where, name), "w") as f:
                f.write("PLANTED = True\\n")
            out["planted_in"].append(os.path.join(where, name))
        except OSError:
            pass
print("PROBE " + json.dumps(out), flush=True)
"""
FLOOD = """
import sys
for _ in range(4000):
    sys.stdout.write("y" * 1000 + "\\n")
sys.stdout.flush()
from torchyard import job
job.setup()
job.log(1, **{"train/loss": 1.0})
print("still running after the flood", file=sys.stderr, flush=True)
"""

STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid = os.fork()  # a child that ignores SIGTERM too, in its own session
if pid == 0:
    os.setsid()
    while True:
        time.sleep(0.1)
from torchyard import job
job.setup()
job.log(1, **{"train/loss": 1.0})
while True:
    pass
"""


@pytest.fixture(scope="module", params=[EMBEDDED])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    env = {"TORCHYARD_MAX_LOG_BYTES": str(200_000)}
    yield from backend_cluster(request, tmp_path_factory, schedulers=1, extra_env=env)


@pytest.fixture(scope="module")
def sdk(cluster: Cluster) -> Iterator[Client]:
    with Client(url=cluster.url, token=cluster.token) as client:
        yield client


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile-bundle")
    (d / "probe.py").write_text(PROBE)
    (d / "flood.py").write_text(FLOOD)
    (d / "stubborn.py").write_text(STUBBORN)
    return d


def _probe(cluster: Cluster, sdk: Client, bundle: Path, targets: list[str]) -> dict[str, Any]:
    spec = {"entrypoint": {"script": "probe.py", "args": targets}}
    job = sdk.submit(spec, code=bundle)
    cluster.wait_state(job["id"], "succeeded", timeout=120)
    text = cluster.http.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 4 * 1024 * 1024}).json()[
        "data"
    ]
    line = next(x for x in text.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def test_a_script_reaches_nothing_of_the_worker_or_other_jobs(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    # What `torchyard up` keeps in its home, and another user's finished job.
    token_file = cluster.home / "admin-token"
    token_file.write_text(cluster.token)
    token_file.chmod(0o600)
    other = sdk.submit({"entrypoint": {"script": "probe.py"}}, code=bundle)
    cluster.wait_state(other["id"], "succeeded", timeout=120)
    other_files = sorted(
        p for p in (cluster.storage / "jobs" / other["id"]).rglob("*") if p.is_file()
    )
    assert other_files
    worker_pid = cluster.procs["worker-0"].pid if "worker-0" in cluster.procs else os.getpid()
    targets = [
        str(token_file),
        str(cluster.home / "torchyard.db"),
        *(str(p) for p in other_files),
        f"/proc/{worker_pid}/environ",
        f"/proc/{os.getpid()}/environ",
        "/proc/1/environ",
    ]
    out = _probe(cluster, sdk, bundle, targets)
    assert all(v != "READ" for v in out["read"].values()), out["read"]
    assert not [k for k in out["env"] if k.startswith("TORCHYARD_") and k != "TORCHYARD_ATTEMPT"
                and not k.startswith(("TORCHYARD_LEASE", "TORCHYARD_DATA_ROOT", "TORCHYARD_COLLECTIVE",
                                      "TORCHYARD_MAX_MODEL"))
                and k != "TORCHYARD_PARAMS"]  # the job's own spec params, set by its runner  # fmt: skip
    assert out["uid"] != 0


def test_a_job_leaves_nothing_that_another_job_imports(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    first = _probe(cluster, sdk, bundle, [])  # plants planted.py / yaml.py where it can
    second = _probe(cluster, sdk, bundle, [])  # the same bundle: the same unpacked cache
    assert first["planted_in"]  # beside its script and in its cwd: its own copy, its business
    assert second["imported_planted"] is False  # nothing of it reached the next job


def test_a_flood_of_output_is_cut_and_the_job_goes_on(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    job = sdk.submit({"entrypoint": {"script": "flood.py"}}, code=bundle)
    done = cluster.wait_state(job["id"], "succeeded", timeout=120)
    assert done["latest_metrics"]["train/loss"]["value"] == 1.0  # it went on after the cut
    log = cluster.storage / "jobs" / job["id"] / "output.log"
    size = log.stat().st_size
    assert size < 200_000 + 4096, size  # the cap, its marker and the worker's own lines
    assert "log cut" in log.read_text(errors="replace")


def test_a_job_that_ignores_sigterm_is_cancelled_within_10s_and_frees_its_worker(
    cluster: Cluster, sdk: Client, bundle: Path
) -> None:
    job = sdk.submit({"entrypoint": {"script": "stubborn.py"}}, code=bundle)
    cluster.wait_state(job["id"], "running", timeout=120)
    t0 = time.monotonic()
    assert cluster.http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    cluster.wait_state(job["id"], "cancelled", timeout=10)
    assert time.monotonic() - t0 <= 10
    worker = cluster.job(job["id"])["attempts"][-1]["workers"][0]["worker_id"]

    def idle() -> bool:
        rows = {w["id"]: w for w in cluster.get("/v1/workers")["items"]}
        return rows[worker]["state"] == "idle" and rows[worker].get("current_job_id") is None

    wait_for(idle, 10, f"worker {worker} to be idle again")
    # The pool runs the next jobs (two at once: both workers, that one included).
    nxt = [sdk.submit({"entrypoint": {"script": "probe.py"}}, code=bundle) for _ in range(2)]
    for j in nxt:
        cluster.wait_state(j["id"], "succeeded", timeout=120)
