"""The fault suite: real processes on a private PostgreSQL and Redis, a private object
store (SeaweedFS) holding every file, two hosts (one in its own network namespace) that
share no directory, jobs of both world sizes (the first one across the two hosts, killed
on the second host mid-run and resumed there), and every kind of ordinary fault at seeded
random moments, the object store going away among them. Then: every job succeeded, every
metric the trainers wrote is stored once, every checkpoint on record is an object in the
store with its recorded size and sha256, every succeeded job's weights are stored as
recorded and equal an uninterrupted run's bit for bit, no two attempts of a job ever ran
at once, every job's ending reached a webhook receiver (no notification lost), and
nothing is left running or busy.

Bounded by default (part of `bash scripts/test.sh`); `-m chaos --chaos-minutes N` soaks.
Replay a failure with `--chaos-seed S` (the seed is printed first)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cluster import REMOTE, ChaosCluster
from faults import Injector, describe_processes, leftover_trainers
from invariants import check, notification_problems
from netns import SecondHost
from seaweed import Seaweed, SeaweedError, start_seaweed
from support.services import PrivatePostgres, PrivateRedis, missing_tools
from support.webhook_receiver import Receiver, receiver
from support.worker_cluster import ROOT, checkpointed_and_running, wait_for

pytestmark = pytest.mark.chaos

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
MIN_JOBS = 12
ACTIVE = 4  # jobs kept queued or running at once
SETTLE_S = 30  # after the last job ended: its trainers exit, its workers release themselves
_BASE: dict[str, Any] = {
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "log_every_steps": 1,
    "max_restarts": 100,
    "precision": "fp32",
}
SPECS: dict[str, dict[str, Any]] = {
    "digits-1": {**_BASE, "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits"},
                 "batch_size": 64, "epochs": 5, "seed": 1,
                 "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2}},
    "synthetic-1": {**_BASE, "model": {"name": "mlp", "hidden": [64]},
                    "data": {"name": "synthetic", "shape": [1, 8, 8], "size": 3000, "num_classes": 10},
                    "batch_size": 50, "epochs": 4, "seed": 2,
                    "checkpoint": {"every_steps": 15, "every_epochs": None, "keep_last": 2}},
    "digits-2": {**_BASE, "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits"},
                 "batch_size": 64, "epochs": 5, "seed": 3, "world_size": 2,
                 "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2}},
    # The cross-host job that is killed mid-run: long enough (~360 steps) that it is still
    # training when its first checkpoint has gone through the object store.
    "digits-2-long": {**_BASE, "model": {"name": "mlp", "hidden": [32]},
                      "data": {"name": "digits"}, "batch_size": 64, "epochs": 20, "seed": 6,
                      "world_size": 2,
                      "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2}},
    "synthetic-2": {**_BASE, "model": {"name": "mlp", "hidden": [64]},
                    "data": {"name": "synthetic", "shape": [1, 8, 8], "size": 3000, "num_classes": 10},
                    "batch_size": 50, "epochs": 4, "seed": 4, "world_size": 2,
                    "checkpoint": {"every_steps": 15, "every_epochs": None, "keep_last": 2}},
    # Checkpoints of ~14 MB: bigger than socket buffers, for the stalled downloads.
    "big-1": {**_BASE, "model": {"name": "mlp", "hidden": [1024, 1024]},
              "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 1500, "num_classes": 10},
              "batch_size": 50, "epochs": 2, "seed": 5,
              "checkpoint": {"every_steps": 10, "every_epochs": None, "keep_last": 2}},
}  # fmt: skip
MIX = ["digits-1", "synthetic-1", "digits-2", "big-1", "synthetic-2", "digits-1", "synthetic-1"]


def _reference(key: str, out: Path) -> Path:
    """An uninterrupted run of the spec on one host: `python -m torchyard.trainer`, or torchrun with
    two local processes for world_size 2 (same thread count as the workers')."""
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(SPECS[key]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHYARD_", "GLOO_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    tail = [
        "-m",
        "torchyard.trainer",
        "--spec",
        str(out / "spec.json"),
        "--run-dir",
        str(out / "run"),
    ]
    ws = SPECS[key].get("world_size", 1)
    launcher = [] if ws == 1 else ["-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={ws}"]  # fmt: skip
    subprocess.run([sys.executable, *launcher, *tail], env=env, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)  # fmt: skip
    return out / "run" / "model.safetensors"


@pytest.fixture
def chaos_cluster(tmp_path: Path) -> Iterator[ChaosCluster]:
    missing = missing_tools()
    if missing:
        msg = f"the fault suite needs {', '.join(missing)}"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    host2 = SecondHost()
    pg = redis = c = None
    s3: Seaweed | None = None
    try:
        host2.create()
        try:  # its S3 endpoint on the address the second host reaches (this one too)
            s3 = start_seaweed(tmp_path / "s3", bind=host2.root_addr)
        except (SeaweedError, OSError) as e:
            pytest.fail(f"SeaweedFS (weed) could not start: {e}", pytrace=False)
        pg = PrivatePostgres(listen=("127.0.0.1", host2.root_addr))
        pg.start()
        redis = PrivateRedis(bind=("127.0.0.1", host2.root_addr))
        redis.start()
        c = ChaosCluster(tmp_path, pg, redis, host2, s3)
        c.start_services()
        yield c
    finally:
        if c is not None:
            c.teardown()
        if redis is not None:
            redis.stop()
        if pg is not None:
            pg.destroy()
        if s3 is not None:
            s3.stop()
        host2.destroy()


def test_nothing_lost_nothing_stuck_under_faults(
    chaos_cluster: ChaosCluster,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = chaos_cluster
    for k, v in c.s3.env().items():  # the checks read the object store with boto3's chain
        monkeypatch.setenv(k, v)
    minutes = float(request.config.getoption("--chaos-minutes") or 0)
    seed = request.config.getoption("--chaos-seed")
    seed = random.randrange(1 << 31) if seed is None else int(seed)
    print(f"chaos seed={seed} minutes={minutes or 'bounded'}", flush=True)
    rng = random.Random(seed)
    t_start = time.monotonic()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t_start:6.1f}s] {msg}"
        log_lines.append(line)
        print(line, flush=True)

    hooks = contextlib.ExitStack()
    rx = hooks.enter_context(receiver())  # every job's ending is POSTed here (webhook)
    request.addfinalizer(hooks.close)
    r = c.http.post("/v1/webhooks", json={"url": f"{rx.url}/ok",
                    "events": ["job.succeeded", "job.failed", "job.cancelled"]})  # fmt: skip
    assert r.status_code == 201, r.text
    refs_pool = ThreadPoolExecutor(max_workers=1)
    refs = {k: refs_pool.submit(_reference, k, tmp_path / "ref" / k) for k in SPECS}

    # DDP across the two hosts: while only w0 (here) and the remote worker exist, a
    # world_size-2 job must take one rank on each.
    c.start_worker("w0")
    c.start_worker(REMOTE)
    c.wait_workers(2, timeout=120)
    jobs: dict[str, str] = {}  # job id -> spec key
    cross = c.tolerant_submit(SPECS["digits-2-long"])
    jobs[cross["id"]] = "digits-2-long"
    a = wait_for(lambda: (j := c.job(cross["id"]))["attempts"] and j["attempts"][0], 120,
                 "the cross-host job's first attempt")  # fmt: skip
    assert {w["worker_id"] for w in a["workers"]} == {"w0", REMOTE}
    # Killed on one host mid-run: once it has a checkpoint, the second host's worker is
    # SIGKILLed (its rank dies with it) and comes back; w1 is not up yet, so the job
    # resumes across the same two hosts, each rank reading the checkpoint from the store.
    wait_for(lambda: checkpointed_and_running(c, cross["id"], 10), 120,
             "a checkpoint of the cross-host job")  # fmt: skip
    log("cross-host job checkpointed: killing its worker on the second host")
    c.kill(REMOTE, signal.SIGKILL)
    c.start_worker(REMOTE)
    c.wait_registered(REMOTE)
    try:
        resumed = wait_for(lambda: len(j := c.job(cross["id"])["attempts"]) > 1 and j[1], 120,
                           "the cross-host job's second attempt")  # fmt: skip
    except TimeoutError:
        j = c.job(cross["id"])
        raise AssertionError(
            f"no second attempt: the job is {j['state']} ({j.get('error') or j.get('pending_reason')}), "
            f"attempts {[(a['number'], a['state'], a.get('reason')) for a in j['attempts']]}"
        ) from None
    assert {w["worker_id"] for w in resumed["workers"]} == {"w0", REMOTE}
    log("cross-host job resumed")
    c.start_worker("w1")
    c.wait_registered("w1")

    stop = threading.Event()
    injector = Injector(c, rng, long=minutes > 0, log=log)
    until = t_start + minutes * 60
    inj = threading.Thread(target=lambda: injector.run(until, stop), name="injector")
    inj.start()
    terminal = ("succeeded", "failed", "cancelled")
    try:
        i = 0
        while inj.is_alive() or len(jobs) < MIN_JOBS:
            active = [j for j in jobs if c.tolerant_get(f"/v1/jobs/{j}")["state"] not in terminal]
            if len(active) < ACTIVE:
                key = MIX[i % len(MIX)]
                i += 1
                jobs[c.tolerant_submit(SPECS[key])["id"]] = key
            time.sleep(0.5)
    finally:
        stop.set()
        inj.join()
    log(f"faults done: {dict(injector.done)}; waiting for {len(jobs)} jobs")

    def all_ended() -> dict[str, dict[str, Any]] | None:
        final = {j: c.tolerant_get(f"/v1/jobs/{j}") for j in jobs}
        return final if all(v["state"] in terminal for v in final.values()) else None

    try:
        final = wait_for(all_ended, 420, "every job to end", every=1.0)
    except TimeoutError:
        for j in jobs:  # what each job that did not end is waiting for
            v = c.tolerant_get(f"/v1/jobs/{j}")
            if v["state"] not in terminal:
                last = v["attempts"][-1] if v["attempts"] else {}
                log(f"not ended: {j} {jobs[j]} {v['state']} pending={v.get('pending_reason')!r} "
                    f"attempt={ {k: last.get(k) for k in ('number', 'state', 'reason', 'workers')} }")  # fmt: skip
        log(
            f"workers: { {w: (x['state'], x.get('current_job_id')) for w, x in c.workers().items()} }"
        )
        raise
    for j, v in final.items():
        v["_ref"] = jobs[j]
    references = {k: f.result() for k, f in refs.items()}
    refs_pool.shutdown()

    store = c.object_store(tmp_path / "checker-cache")
    report = check(c.pg.url(), store, c.caches, final, references)
    report.problems.extend(cross_host_problems(c, cross["id"], final[cross["id"]]))
    report.problems.extend(_notifications(rx, final))
    numbers = re.compile(r"[0-9a-f]{32}|\d+(\.\d+)?")
    endings = Counter(
        f"{a['state']}: {numbers.sub('#', a.get('reason') or '')[:90]}"
        for v in final.values()
        for a in v["attempts"]
    )
    log("attempt endings: " + "; ".join(f"{n}x {k}" for k, n in endings.most_common(8)))

    def busy_now() -> list[str]:
        return [w["id"] for w in c.workers().values() if w["state"] == "busy"]

    # A trainer exits, and its worker releases itself, just after its job's end is recorded
    # (a peer rank on another host after the rank that decided): both get a bounded while.
    ended_at = time.monotonic()
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not leftover_trainers(c.caches), SETTLE_S, "no trainer left")
    leftover = leftover_trainers(c.caches)
    log(f"trainers gone {time.monotonic() - ended_at:.1f}s after the last job ended"
        if not leftover else f"trainers left after {SETTLE_S}s: {describe_processes(leftover)}")  # fmt: skip
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not busy_now(), SETTLE_S, "no busy worker")
    busy = busy_now()
    stalls = injector.stall_checks
    line = report.line(
        faults=sum(injector.done.values()),
        fault_kinds=len(injector.done),
        leftover_trainers=len(leftover),
        busy_workers=len(busy),
        get_job_during_stall_max_s=f"{max(stalls):.2f}" if stalls else "n/a",
        wall_s=f"{time.monotonic() - t_start:.0f}",
        seed=seed,
    )
    print(line, flush=True)
    (tmp_path / "chaos-report.txt").write_text(
        "\n".join([*log_lines, line, *injector.failures, *report.problems])
    )
    keep_job_records(c, report.problems, tmp_path / "failed-jobs")
    assert injector.failures == [], "\n".join(injector.failures)
    assert set(injector.done) == set(Injector.KINDS), injector.done
    assert report.problems == [], "\n".join(report.problems)
    assert leftover == [] and busy == [], (describe_processes(leftover), busy)


def _notifications(rx: Receiver, final: dict[str, dict[str, Any]]) -> list[str]:
    """No notification lost: each ended job's webhook POST arrives (the sender retries and
    a killed scheduler's leases expire; waits up to a minute for the last ones)."""

    def seen() -> list[tuple[str, str, str]]:
        return [(r.delivery, r.headers.get("x-torchyard-event", ""),
                 json.loads(r.body).get("job", {}).get("id", "")) for r in rx.received()]  # fmt: skip

    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not notification_problems(final, seen()), 60, "every notification")
    return notification_problems(final, seen())


def cross_host_problems(c: ChaosCluster, job_id: str, final: dict[str, Any]) -> list[str]:
    """The job killed on the second host resumed from a checkpoint on both hosts (each
    rank's banner in its own log, read through the API from the store), and its weights
    download through the API as recorded."""
    problems = []
    for rank in (0, 1):
        text = log_through_api(c, job_id, rank)
        banners = re.findall(r"===== torchyard: attempt (\d+), rank \d+/2, worker (\w+), .*? "
                             r"(resuming from \S+|fresh start) =====", text)  # fmt: skip
        if not any(int(n) >= 2 and how.startswith("resuming") for n, _, how in banners):
            problems.append(f"{job_id}: rank {rank} never resumed: {banners}")
    hosts = [{w["worker_id"] for w in a["workers"]} for a in final["attempts"]]
    if len(hosts) < 2 or hosts[1] != {"w0", REMOTE}:
        problems.append(f"{job_id}: its first resume was not across the two hosts: {hosts}")
    r = c.http.get(f"/v1/jobs/{job_id}/checkpoints/latest/download", params={"kind": "weights"})
    rows = c.tolerant_get(f"/v1/jobs/{job_id}/checkpoints")["items"]
    want = [ck["sha256"] for ck in rows if ck["kind"] == "weights"]
    got = hashlib.sha256(r.content).hexdigest() if r.status_code == 200 else r.status_code
    if [got] != want:
        problems.append(f"{job_id}: weights downloaded through the API: {got}, recorded {want}")
    return problems


def log_through_api(c: ChaosCluster, job_id: str, rank: int) -> str:
    out, offset = [], 0
    while True:
        chunk = c.tolerant_get(f"/v1/jobs/{job_id}/logs", offset=offset, limit=1 << 20, rank=rank)
        out.append(chunk["data"])
        if chunk["next_offset"] >= chunk["size"] or not chunk["data"]:
            return "".join(out)
        offset = chunk["next_offset"]


def keep_job_records(c: ChaosCluster, problems: list[str], into: Path) -> None:
    """The logs and events of every job a problem names, from each host's cache, kept
    beside the report: the caches go with the cluster (checkpoints are left out: large)."""
    from torchyard.store.paths import job_dir

    for job_id in sorted({p.split(":", 1)[0] for p in problems if re.match(r"[0-9a-f]{32}:", p)}):
        for host, cache in zip(("host1", "host2"), c.caches, strict=True):
            src = job_dir(cache, job_id)
            if src.is_dir():
                shutil.copytree(src, into / job_id / host,
                                ignore=shutil.ignore_patterns("checkpoints"))  # fmt: skip
