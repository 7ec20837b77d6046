"""The same sweep without a pruner and with ASHA: best value and worker-seconds.

    .venv/bin/python bench/sweep_bench.py [--trials 16] [--parallel 2] [--epochs 60]

Starts `torchyard api`, `torchyard scheduler` and two CPU workers on the embedded defaults
(SQLite + the filesystem broker, as `torchyard up`), then runs one --trials search of
digits (a TPE sampler over the learning rate, the hidden layers and the weight decay; the
same seed, so the same first samples) with `pruner: none`, then with `pruner: asha`. For
each: the best val/accuracy of a complete trial, and the worker-seconds it used (the sum
over its trials' attempts of (ended - started) x world_size). Goal: ASHA's best within
0.005 of the unpruned search's, for at most half its worker-seconds.

Every trial also pays a fixed cost that no pruner saves (a cold trainer start, ~3 s here,
when the worker's warm trainer is still restarting after its previous trial, and the
stop): trials must train long enough for pruning to show, hence 60 epochs of MLPs of 512
to 1024x1024 units, 5 to 20 s each on one CPU thread.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import benchlib

sys.path.insert(0, str(benchlib.ROOT / "tests" / "worker"))

from worker_cluster import Cluster, wait_for

from torchyard.client.sdk import Client

GOAL_BEST_WITHIN = 0.005
GOAL_RATIO = 0.5


def sweep_body(args: argparse.Namespace, pruner: str) -> dict[str, Any]:
    spec = {
        "model": {"name": "mlp", "hidden": [512]},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "schedule": {"name": "cosine"},
        "batch_size": 16,
        "epochs": args.epochs,
        "checkpoint": {"every_epochs": None},
        "seed": args.seed,
    }
    space = {
        "optimizer.lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
        "model.hidden": {"type": "categorical", "choices": [[512], [1024], [1024, 1024]]},
        "optimizer.weight_decay": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
    }
    return {
        "name": f"bench-{pruner}", "spec": spec, "space": space,
        "objective": {"metric": "val/accuracy", "mode": "max"},
        "trials": args.trials, "parallel": args.parallel, "sampler": "tpe", "pruner": pruner,
    }  # fmt: skip


def _seconds(a: Any, b: Any) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def worker_seconds(ty: Client, sweep: dict[str, Any]) -> dict[str, float]:
    """Per trial job: the sum over its attempts of (ended - started) x world_size."""
    out = {}
    for t in sweep["trials"]:
        if t["job_id"] is None:
            continue
        job = ty.job(t["job_id"])
        spans = [_seconds(a["started_at"], a["ended_at"]) for a in job["attempts"]
                 if a["started_at"] and a["ended_at"]]  # fmt: skip
        out[t["job_id"]] = sum(spans) * job["world_size"]
    return out


def run_sweep(ty: Client, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    sweep_id = ty.create_sweep(body)["id"]

    def ended() -> dict[str, Any] | None:
        s = ty.get_sweep(sweep_id)
        return s if s["state"] != "running" else None

    sweep = wait_for(ended, 3600, f"sweep {sweep_id}", every=1.0)
    seconds = worker_seconds(ty, sweep)
    return {
        "sweep": sweep,
        "wall_s": time.monotonic() - t0,
        "seconds": seconds,
        "worker_s": sum(seconds.values()),
        "best": (sweep["best"] or {}).get("value"),
    }


def report(name: str, r: dict[str, Any]) -> None:
    s = r["sweep"]
    best = s["best"] or {}
    print(
        f"{name:>5}: best val/accuracy {r['best']}  worker-seconds {r['worker_s']:7.1f}  "
        f"wall {r['wall_s']:6.1f} s  trials {s['counts']}  state {s['state']}"
    )
    print(f"       best trial {best.get('number')}: {best.get('params')}")
    for t in s["trials"]:
        print(f"       #{t['number']:<2} {t['status']:<8} step {t['step']}  value {t['value']}  "
              f"{r['seconds'].get(t['job_id'], 0.0):5.1f} s  {t['params']}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60, help="epochs of an unpruned trial")
    p.add_argument("--seed", type=int, default=0, help="the spec's seed: the sampler's too")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ty-sweep-bench-"))
    extra = {"TORCHYARD_HEARTBEAT_INTERVAL_S": "2", "TORCHYARD_HEARTBEAT_TIMEOUT_S": "20"}
    c = Cluster(tmp, extra_env=extra)  # SQLite + filesystem broker
    try:
        c.start(workers=2)
        with Client(url=c.url, token=c.token) as ty:
            plain = run_sweep(ty, sweep_body(args, "none"))
            asha = run_sweep(ty, sweep_body(args, "asha"))
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"backend: SQLite + filesystem broker; 2 CPU workers; {args.trials} trials, "
        f"{args.parallel} at once, {args.epochs} epochs each, TPE, seed {args.seed}"
    )
    report("none", plain)
    report("asha", asha)
    ratio = asha["worker_s"] / plain["worker_s"]
    gap = (plain["best"] or 0.0) - (asha["best"] or 0.0)
    print(f"asha/none worker-seconds: {ratio:.2f}x (goal <= {GOAL_RATIO})")
    print(f"best value gap (none - asha): {gap:+.4f} (goal <= {GOAL_BEST_WITHIN})")
    met = ratio <= GOAL_RATIO and gap <= GOAL_BEST_WITHIN
    print("goal " + ("met" if met else "NOT met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
