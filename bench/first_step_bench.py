"""Submit -> first optimizer step, with the worker's warm trainer and without it.

    .venv/bin/python bench/first_step_bench.py [--repeats 5]

Starts `torchyard api` and `torchyard scheduler` on the embedded defaults (SQLite + the
filesystem broker, as `torchyard up`), then one idle CPU worker at a time: first with
TORCHYARD_WARM_TRAINER=1, then =0 (both sandboxed, the default), then warm with
TORCHYARD_SANDBOX=off, for --rounds rounds. Each submits --repeats tiny
world_size-1 jobs one after another and measures, from just before POST /v1/jobs:
- first step: the trainer's first `metric` event (its own `time`, log_every_steps 1, so
  the metrics of step 1: the first optimizer step has completed);
- started: the trainer's `started` event (model and data ready, before the first step).
Before each submit the worker is idle and --settle seconds have passed, so a warm
worker's next standby has finished its imports (as on a worker that was idle). Goal:
first step median <= 500 ms warm (sandboxed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
from support.worker_cluster import Cluster

from torchyard.store.paths import EVENTS_FILE, job_dir

TINY: dict[str, Any] = {**benchlib.TINY, "max_steps": 5}


def _event_time(events: Path, kind: str) -> float:
    for line in events.read_text().splitlines():
        ev = json.loads(line)
        if ev["type"] == kind:
            return float(ev["time"])
    raise RuntimeError(f"no {kind} event in {events}")


def one_job(c: Cluster, settle_s: float) -> dict[str, float]:
    c.wait_workers(1)
    time.sleep(settle_s)
    t0 = time.time()
    job = c.submit(TINY)
    c.wait_state(job["id"], "succeeded")
    events = job_dir(c.storage, job["id"]) / EVENTS_FILE
    return {
        "started_ms": (_event_time(events, "started") - t0) * 1000,
        "first_step_ms": (_event_time(events, "metric") - t0) * 1000,
    }


def phase(
    c: Cluster, name: str, warm: bool, repeats: int, settle_s: float, sandbox: str = "on"
) -> list[dict]:
    """One worker with the warm trainer on or off: a warm-up job, then `repeats` measured."""
    env = {"TORCHYARD_WARM_TRAINER": "1" if warm else "0", "TORCHYARD_SANDBOX": sandbox}
    p = c.start_worker(name, env)
    try:
        one_job(c, settle_s)  # warm-up: first imports of the worker's own code paths
        return [one_job(c, settle_s) for _ in range(repeats)]
    finally:
        p.terminate()
        p.wait(timeout=60)  # deregistered on the way out: the next phase's worker is alone


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="measured jobs per phase")
    p.add_argument("--rounds", type=int, default=1, help="warm then cold, this many times")
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before each submit")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ty-first-step-"))
    extra = {"TORCHYARD_HEARTBEAT_INTERVAL_S": "2", "TORCHYARD_HEARTBEAT_TIMEOUT_S": "20"}
    c = Cluster(tmp, extra_env=extra)  # no database/broker URL: SQLite + filesystem broker
    res: dict[str, list[dict]] = {"warm": [], "cold": [], "warm, sandbox off": []}
    try:
        c.start(workers=1)  # the cluster helper waits for a worker: stop it, then ours
        c.procs["w0"].terminate()
        c.procs["w0"].wait(timeout=60)
        for r in range(args.rounds):
            res["warm"] += phase(c, f"warm{r}", True, args.repeats, args.settle)
            res["cold"] += phase(c, f"cold{r}", False, args.repeats, args.settle)
            res["warm, sandbox off"] += phase(
                c, f"off{r}", True, args.repeats, args.settle, sandbox="off"
            )
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"backend: SQLite + filesystem broker; one idle CPU worker; {args.repeats} x {args.rounds}"
    )
    print(benchlib.sandbox_line())
    med: dict[str, dict[str, float]] = {}
    for kind, rows in res.items():
        med[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for k in rows[0]:
            xs = ", ".join(f"{r[k]:.0f}" for r in rows)
            print(f"{kind:>17} {k:>14}: median {med[kind][k]:7.0f} ms   [{xs}]")
    for k in med["warm"]:
        print(f"cold/warm {k}: {med['cold'][k] / med['warm'][k]:.1f}x")
        off = med["warm, sandbox off"][k]
        print(f"warm sandboxed/unsandboxed {k}: {med['warm'][k] / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
