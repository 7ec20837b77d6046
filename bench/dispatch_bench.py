"""Dispatch latency and supervision overhead of torchyard's scheduler and workers.

    .venv/bin/python bench/dispatch_bench.py                 # Redis + PostgreSQL (local)
    .venv/bin/python bench/dispatch_bench.py --embedded      # SQLite + filesystem broker

Starts `torchyard api`, `torchyard scheduler` and one CPU worker as processes, then:
1. submits --jobs tiny jobs one after another, each to an idle worker, and measures
   - dispatch: POST /v1/jobs returned -> the trainer process exists (the worker records
     the attempt's started_at right after the trainer's fork/exec), p50 / p95;
   - first metric: POST returned -> the first metric row is in the store;
2. runs one longer spec standalone (`python -m torchyard.trainer`) and under the worker, alternating
   --repeats times, and compares the trainer's own samples/s (its `finished` event).
Goals: dispatch p50 <= 150 ms; supervision overhead <= 3 %.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import benchlib
from sqlalchemy import create_engine, func, select, text
from support.worker_cluster import Cluster, wait_for

from torchyard.store.models import Attempt, Metric

THROUGHPUT: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [1024, 1024]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 20000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 64,
    "epochs": 2,
    "checkpoint": {"every_epochs": 1, "keep_last": 1},
    "log_every_steps": 10,
}


def dispatch(c: Cluster, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"post_ms": [], "dispatch_ms": [], "first_metric_ms": []}
    for i in range(n + 1):  # the first is a warm-up
        c.wait_workers(1)
        t0 = time.time()
        job = c.submit(benchlib.TINY)
        t_post = time.time()
        jid = job["id"]

        def started(jid: str = jid) -> float | None:
            with c.session() as s:
                ts = s.scalar(select(Attempt.started_at).where(Attempt.job_id == jid))
            return ts.timestamp() if ts else None

        t_start = wait_for(started, 60, "the trainer to start", every=0.002)

        def metric(jid: str = jid) -> float | None:
            with c.session() as s:
                n_rows = s.scalar(
                    select(func.count()).select_from(Metric).where(Metric.job_id == jid)
                )
            return time.time() if n_rows else None

        t_metric = wait_for(metric, 120, "a first metric", every=0.005)
        c.wait_state(jid, "succeeded")
        if i == 0:
            continue
        out["post_ms"].append((t_post - t0) * 1000)
        out["dispatch_ms"].append((t_start - t_post) * 1000)
        out["first_metric_ms"].append((t_metric - t_post) * 1000)
    return out


def _samples_per_s(events: Path) -> float:
    for line in reversed(events.read_text().splitlines()):
        ev = json.loads(line)
        if ev["type"] == "finished":
            return float(ev["metrics"]["train/samples_per_s"])
    raise RuntimeError(f"no finished event in {events}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(c: Cluster, repeats: int, tmp: Path) -> dict[str, list[float]]:
    from torchyard.store.paths import EVENTS_FILE, job_dir

    res: dict[str, list[float]] = {"standalone": [], "worker": [], "worker_cpu_share": []}
    worker_pid = c.procs["w0"].pid
    spec_path = tmp / "throughput.json"
    spec_path.write_text(json.dumps(THROUGHPUT))
    env = dict(c.env, PYTHONPATH=str(benchlib.ROOT), TORCHYARD_DIE_WITH_PARENT="1")
    for r in range(repeats):
        run_dir = tmp / f"standalone-{r}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torchyard.trainer",
                "--spec",
                str(spec_path),
                "--run-dir",
                str(run_dir),
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        res["standalone"].append(_samples_per_s(run_dir / EVENTS_FILE))
        c.wait_workers(1)
        cpu0, t0 = cpu_seconds(worker_pid), time.monotonic()
        job = c.submit(THROUGHPUT)
        c.wait_state(job["id"], "succeeded", timeout=600)
        # The worker's own CPU while it supervised, as a share of one core.
        res["worker_cpu_share"].append((cpu_seconds(worker_pid) - cpu0) / (time.monotonic() - t0))
        res["worker"].append(_samples_per_s(job_dir(c.storage, job["id"]) / EVENTS_FILE))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="throughput runs of each kind")
    p.add_argument("--embedded", action="store_true", help="SQLite + filesystem broker")
    p.add_argument("--pg-admin", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    p.add_argument("--skip-dispatch", action="store_true")
    p.add_argument("--threads", default="1", help="OMP_NUM_THREADS of every trainer")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ty-bench-"))
    db_name = None
    kw: dict[str, Any] = {}
    if not args.embedded:
        db_name = f"ty_bench_{uuid.uuid4().hex[:8]}"
        admin = create_engine(args.pg_admin, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{db_name}"'))
        kw = {
            "database_url": args.pg_admin.rsplit("/", 1)[0] + "/" + db_name,
            "broker_url": args.redis,
        }
    # Production-like timings, not the tests' fast ones.
    extra = {
        "TORCHYARD_HEARTBEAT_INTERVAL_S": "2",
        "TORCHYARD_HEARTBEAT_TIMEOUT_S": "20",
        "OMP_NUM_THREADS": args.threads,
    }
    c = Cluster(tmp, extra_env=extra, **kw)
    try:
        c.start(workers=1)
        d = {} if args.skip_dispatch else dispatch(c, args.jobs)
        t = throughput(c, args.repeats, tmp)
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if db_name:
            from torchyard.store.db import dispose_engines

            dispose_engines()
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
    backend = "SQLite + filesystem broker" if args.embedded else "PostgreSQL + Redis"
    print(f"backend: {backend}; {args.jobs} jobs; {os.cpu_count()} CPUs")
    print(benchlib.sandbox_line())
    for k, xs in d.items():
        print(
            f"{k:>16}: p50 {benchlib.pct(xs, 50):7.1f} ms   p95 {benchlib.pct(xs, 95):7.1f} ms   max {max(xs):7.1f} ms"
        )
    sa, wo = statistics.median(t["standalone"]), statistics.median(t["worker"])
    print(f"samples/s standalone: {[round(x) for x in t['standalone']]} median {sa:.0f}")
    print(f"samples/s under worker: {[round(x) for x in t['worker']]} median {wo:.0f}")
    print(f"supervision overhead (medians): {(1 - wo / sa) * 100:+.2f} % (positive = slower)")
    sb, wb = max(t["standalone"]), max(t["worker"])
    print(f"supervision overhead (best of each): {(1 - wb / sb) * 100:+.2f} %")
    share = statistics.median(t["worker_cpu_share"]) * 100
    print(f"worker process CPU while supervising: {share:.2f} % of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
