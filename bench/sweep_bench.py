"""The same sweeps without a pruner and with each pruner asked for (ASHA and synchronous
halving), over several sampler seeds: best value, worker-seconds, and the latencies of the
trial path.

    .venv/bin/python bench/sweep_bench.py [--trials 16] [--parallel 2] [--epochs 30]
        [--seeds 0,1,2] [--sampler random] [--pruners asha,halving] [--record curves.json]

Starts `torchyard api`, `torchyard scheduler` and --workers CPU workers (3: one more than
--parallel, so that the slot a trial left refills its warm trainer while the next trial
starts on a warm one) on the embedded defaults (SQLite + the filesystem broker, as
`torchyard up`; trainers sandboxed, warm trainers on),
then for each seed runs one --trials search of digits (lr, hidden layers, weight decay)
with `pruner: none`, then the same search with each of --pruners. The random sampler gives
them all the same trials, so "the same best" is a like-for-like question; `--sampler tpe`
lets the pruned trials steer the search instead.

Per sweep: the best val/accuracy of a complete trial and the worker-seconds used (the sum
over its trials' attempts of (ended - started) x world_size: a paused trial's hand-back
and its restart count). Per seed and pruner: pruner/none worker-seconds and the best-value
gap. Goals (issue 27): the pruned search's best the same as the unpruned one's (within
GOAL_BEST_WITHIN, i.e. at most one validation sample in 359) at <= 0.3x its
worker-seconds, for every seed.

"The same best" is judged on what each search found, a configuration, not on one draw of
it: a sweep's best is the highest of its complete trials' final values, each one training
run (one training seed) of its configuration, so the unpruned sweep's (the highest of ~15
draws) is biased up by the pick itself, and the best of a pruned sweep's 1-5 complete
trials less so. With --reseeds K (default 4) the best configuration of each sweep is
trained again, as ordinary jobs on the same cluster, with training seeds 1..K; the gap
is between the means of the K+1 final values (its own and the K new ones; a
configuration both sweeps found is trained once). Both gaps are printed: the draw's
("raw") and the means' (with the standard error of their difference); the goal is
judged on the means. Training-seed noise of digits' good configurations here: a standard
deviation of up to ~1 validation sample (1.8 and 2.2 for two of 25; 5 seeds each,
bench/records/digits-16x30-reseeds.json).

Latencies, from each trial's events file (the trainer's own clock) and the store:
- placed -> first step: the attempt's creation (the scheduler placed it) to the trainer's
  first `metric` event, at step `log_every_steps` (5): an upper bound of the first step;
  goal median <= 0.5 s;
- the wait at a rung: the trainer's `rung` event to its next event (its verdict read);
- prune decided -> trainer stopped: the verdict file's mtime (the worker wrote it after
  recording the decision) to the trainer's `stopped` event, and to the attempt's end as
  recorded by the worker; goal <= 1 s.

--record FILE keeps every trial's objective curve and worker-seconds (both sweeps of each
seed), for bench/sweep_replay.py to replay through other pruning rules, and the reseeded
final values ("reseeded").
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import benchlib
from support.worker_cluster import Cluster, wait_for

from torchyard.client.sdk import Client
from torchyard.contracts.rungs import verdict_file
from torchyard.store.paths import EVENTS_FILE, job_dir

GOAL_BEST_WITHIN = 0.003  # one validation sample of digits' 359 is 0.0028
VAL_SAMPLES = 359
GOAL_RATIO = 0.3
GOAL_FIRST_STEP_S = 0.5
GOAL_STOP_S = 1.0
OBJECTIVE = "val/accuracy"


def sweep_body(args: argparse.Namespace, pruner: str, seed: int) -> dict[str, Any]:
    spec = {
        "model": {"name": "mlp", "hidden": [512]},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "schedule": {"name": "cosine"},
        "batch_size": 16,
        "epochs": args.epochs,
        "checkpoint": {"every_epochs": None},
        "log_every_steps": 5,
        "seed": 0,
    }
    space = {
        "optimizer.lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
        "model.hidden": {"type": "categorical", "choices": [[512, 512], [1024, 1024]]},
        "optimizer.weight_decay": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
    }
    return {
        "name": f"bench-{pruner}-{seed}", "spec": spec, "space": space,
        "objective": {"metric": OBJECTIVE, "mode": "max"}, "trials": args.trials,
        "parallel": args.parallel, "sampler": args.sampler, "pruner": pruner, "seed": seed,
    }  # fmt: skip


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _events(c: Cluster, job_id: str) -> list[dict[str, Any]]:
    path = job_dir(c.storage, job_id) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trial_figures(c: Cluster, ty: Client, job_id: str) -> dict[str, Any]:
    """One trial's worker-seconds, latencies (None where it has none) and objective curve."""
    job = ty.job(job_id)
    atts = job["attempts"]
    spans = [_ts(a["ended_at"]) - _ts(a["started_at"]) for a in atts
             if a["started_at"] and a["ended_at"]]  # fmt: skip
    events = _events(c, job_id)
    first = next((e["time"] for e in events if e["type"] == "metric"), None)
    out: dict[str, Any] = {
        "worker_s": sum(spans) * job["world_size"],
        "first_step_s": first - _ts(atts[0]["created_at"]) if first and atts else None,
        "waits_s": [
            events[i + 1]["time"] - e["time"]
            for i, e in enumerate(events[:-1])
            if e["type"] == "rung"
        ],
        "curve": ty.metrics(job_id, name=OBJECTIVE).get(OBJECTIVE, {}).get("values", []),
        "epoch_s": _epoch_s(events),
    }
    stopped = [e for e in events if e["type"] == "stopped" and e.get("signal") == "pruned"]
    rungs = [e for e in events if e["type"] == "rung"]
    if stopped and rungs:
        verdict = job_dir(c.storage, job_id) / verdict_file(rungs[-1]["index"])
        decided = verdict.stat().st_mtime
        out["decided_to_stopped_s"] = stopped[-1]["time"] - decided
        out["decided_to_ended_s"] = _ts(atts[-1]["ended_at"]) - decided
    return out


def _epoch_s(events: list[dict[str, Any]]) -> float | None:
    """The median time between the trainer's evaluations of the objective (one epoch each)."""
    times = [e["time"] for e in events if e["type"] == "metric" and e.get("name") == OBJECTIVE]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def run_sweep(c: Cluster, ty: Client, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    sweep_id = ty.create_sweep(body)["id"]

    def ended() -> dict[str, Any] | None:
        s = ty.get_sweep(sweep_id)
        return s if s["state"] != "running" else None

    sweep = wait_for(ended, 3600, f"sweep {sweep_id}", every=1.0)
    figures = {t["job_id"]: trial_figures(c, ty, t["job_id"]) for t in sweep["trials"]
               if t["job_id"] is not None}  # fmt: skip
    return {
        "sweep": sweep,
        "wall_s": time.monotonic() - t0,
        "figures": figures,
        "worker_s": sum(f["worker_s"] for f in figures.values()),
        "best": (sweep["best"] or {}).get("value"),
    }


def reseed(ty: Client, runs: dict[str, dict[str, Any]], k: int) -> dict[str, list[float]]:
    """Each sweep's best configuration trained again with training seeds 1..k: per sweep,
    the k+1 final objective values (its best trial's own first). A configuration that
    several sweeps found is trained once for all of them."""
    draws: dict[str, list[float]] = {}  # params (as JSON) -> final values
    pending: dict[str, list[str]] = {}  # params -> the reseeded jobs
    of_sweep: dict[str, str] = {}
    for name, r in runs.items():
        best = r["sweep"]["best"]
        if best is None:
            continue
        key = json.dumps(best["params"], sort_keys=True)
        of_sweep[name] = key
        if key in draws:
            continue
        draws[key] = [float(best["value"])]
        spec = ty.job(best["job_id"])["spec"]
        pending[key] = [
            ty.submit({**spec, "name": f"reseed-{name}-{seed}", "seed": seed})["id"]
            for seed in range(1, k + 1)
        ]
    for key, jobs in pending.items():
        for job_id in jobs:
            job = ty.wait(job_id, timeout_s=3600)
            if job["state"] != "succeeded":
                raise RuntimeError(f"reseeded job {job_id} {job['state']}: {job.get('error')}")
            values = ty.metrics(job_id, name=OBJECTIVE)[OBJECTIVE]["values"]
            draws[key].append(float(values[-1]))
    return {name: draws[key] for name, key in of_sweep.items()}


def mean_gap(plain: list[float], pruned: list[float]) -> tuple[float, float]:
    """(mean(plain) - mean(pruned), the standard error of that difference); both sweeps'
    best being one configuration (reseed's one list of draws) is no difference at all."""
    if plain is pruned:
        return 0.0, 0.0

    def var_of_mean(xs: list[float]) -> float:
        return statistics.variance(xs) / len(xs) if len(xs) > 1 else 0.0

    gap = statistics.fmean(plain) - statistics.fmean(pruned)
    return gap, (var_of_mean(plain) + var_of_mean(pruned)) ** 0.5


def report(name: str, r: dict[str, Any]) -> None:
    s, best = r["sweep"], r["sweep"]["best"] or {}
    print(f"  {name:>7}: best {r['best']} (trial {best.get('number')})  worker-seconds "
          f"{r['worker_s']:6.1f}  wall {r['wall_s']:5.1f} s  {s['counts']}")  # fmt: skip
    for t in s["trials"]:
        f = r["figures"].get(t["job_id"], {})
        lr = t["params"].get("optimizer.lr")
        print(f"        #{t['number']:<2} {t['status']:<9} {t['state']:<9} step {t['step']!s:>5}  "
              f"value {t['value']!s:<20.20} {f.get('worker_s', 0.0):5.1f} s  lr {lr:.3g}  "
              f"{t['params'].get('model.hidden')}")  # fmt: skip


def _samples(draws: list[float]) -> str:
    """Final values in validation samples right: '354.4 [355 354 355 354 354]'."""
    counts = [round(v * VAL_SAMPLES) for v in draws]
    return f"{statistics.fmean(counts):.1f} [{' '.join(map(str, counts))}]"


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s (n={len(xs)}, max {max(xs):.3f})" if xs else "n/a"


def latencies(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"first_step_s": [], "waits_s": [], "decided_to_stopped_s": [],
                                   "decided_to_ended_s": []}  # fmt: skip
    for r in runs:
        for f in r["figures"].values():
            for k in out:
                v = f.get(k)
                out[k] += v if isinstance(v, list) else [] if v is None else [v]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30, help="epochs of an unpruned trial")
    p.add_argument("--seeds", default="0,1,2", help="the sampler's seeds, one pair each")
    p.add_argument("--sampler", default="random", choices=["random", "tpe"])
    p.add_argument(
        "--pruners",
        default="asha,halving",
        help="each compared with none (`none` alone: the unpruned sweeps only, for --record)",
    )
    p.add_argument("--record", type=Path, help="write each trial's curve here (sweep_replay.py)")
    p.add_argument(
        "--reseeds",
        type=int,
        default=4,
        help="train each sweep's best configuration again with this many other training "
        "seeds; the best-value goal is judged on the means (0: on the single draws)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=3,
        help="CPU workers (one more than parallel: "
        "a trial finds a warm slot while the one its predecessor left refills)",
    )
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.pruners = [x for x in args.pruners.split(",") if x and x != "none"]
    if not set(args.pruners) <= {"asha", "median", "halving"}:
        p.error("--pruners: a comma-separated list of asha, median, halving (or none)")
    if not args.pruners and not args.record:
        p.error("--pruners none only records: give --record")

    print(benchlib.sandbox_line(), file=sys.stderr, flush=True)  # before the ~40 minutes
    tmp = Path(tempfile.mkdtemp(prefix="ty-sweep-bench-"))
    extra = {"TORCHYARD_HEARTBEAT_INTERVAL_S": "2", "TORCHYARD_HEARTBEAT_TIMEOUT_S": "20"}
    c = Cluster(tmp, extra_env=extra)  # SQLite + filesystem broker
    results: list[tuple[int, dict[str, dict[str, Any]]]] = []
    try:
        c.start(workers=args.workers)
        with Client(url=c.url, token=c.token) as ty:
            for seed in seeds:
                runs = {name: run_sweep(c, ty, sweep_body(args, name, seed))
                        for name in ["none", *args.pruners]}  # fmt: skip
                if args.reseeds > 0 and args.pruners:
                    for name, values in reseed(ty, runs, args.reseeds).items():
                        runs[name]["draws"] = values
                results.append((seed, runs))
                if args.record:
                    record(args, results)
                print(f"seed {seed} done", file=sys.stderr, flush=True)
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarise(args, results)


def record(args: argparse.Namespace, results: list[tuple[int, dict[str, Any]]]) -> None:
    """Each seed's trials, every sweep: params, state, worker-seconds, epoch time, curve."""

    def trials(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "number": t["number"], "params": t["params"], "state": t["state"],
                "worker_s": r["figures"][t["job_id"]]["worker_s"],
                "epoch_s": r["figures"][t["job_id"]]["epoch_s"],
                "curve": r["figures"][t["job_id"]]["curve"],
            }
            for t in r["sweep"]["trials"] if t["job_id"] in r["figures"]
        ]  # fmt: skip

    def sweeps(runs: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {name: trials(r) for name, r in runs.items()}
        # each sweep's best configuration's final values over training seeds 0..K
        out["reseeded"] = {name: r["draws"] for name, r in runs.items() if "draws" in r}
        return out

    out = {"epochs": args.epochs, "trials": args.trials, "parallel": args.parallel,
           "seeds": {str(seed): sweeps(runs) for seed, runs in results}}  # fmt: skip
    args.record.write_text(json.dumps(out, indent=1))


def summarise(args: argparse.Namespace, results: list[tuple[int, dict[str, Any]]]) -> int:
    print(f"backend: SQLite + filesystem broker; {args.workers} CPU workers; {args.trials} trials, "
          f"{args.parallel} at once, {args.epochs} epochs, {args.sampler} sampler")  # fmt: skip
    print(benchlib.sandbox_line())
    met = {name: True for name in args.pruners}
    for seed, runs in results:
        print(f"seed {seed}:")
        for name, r in runs.items():
            report(name, r)
        plain = runs["none"]
        for name in args.pruners:
            r = runs[name]
            ratio = r["worker_s"] / plain["worker_s"]
            gap = (plain["best"] or 0.0) - (r["best"] or 0.0)
            judged = gap
            line = f"raw best gap (none - {name}) {gap:+.4f} ({gap * VAL_SAMPLES:+.1f} samples)"
            if "draws" in plain and "draws" in r:
                judged, se = mean_gap(plain["draws"], r["draws"])
                line += (
                    f"; over {len(r['draws'])} training seeds: none's best config "
                    f"{_samples(plain['draws'])}, {name}'s {_samples(r['draws'])}, gap of the "
                    f"means {judged * VAL_SAMPLES:+.2f} ± {se * VAL_SAMPLES:.2f} samples"
                )
            ok = ratio <= GOAL_RATIO and judged <= GOAL_BEST_WITHIN
            met[name] &= ok
            print(f"  seed {seed}: {name}/none worker-seconds {ratio:.3f}x (goal <= {GOAL_RATIO}); "
                  f"{line} (goal <= {GOAL_BEST_WITHIN}): {'met' if ok else 'NOT met'}")  # fmt: skip
    lat = latencies([r for _, runs in results for r in runs.values()])
    first = lat["first_step_s"]
    print(f"placed -> first logged step (step 5), median {_median(first)}; goal <= "
          f"{GOAL_FIRST_STEP_S} s")  # fmt: skip
    print(
        f"wait at a rung (rung event -> the trainer's next event): median {_median(lat['waits_s'])}"
    )
    print(
        f"prune decided -> trainer stopped: median {_median(lat['decided_to_stopped_s'])}; "
        f"-> attempt ended: median {_median(lat['decided_to_ended_s'])}; goal <= {GOAL_STOP_S} s"
    )
    latency_ok = bool(first) and statistics.median(first) <= GOAL_FIRST_STEP_S
    stops = lat["decided_to_stopped_s"]
    latency_ok &= bool(stops) and max(stops) <= GOAL_STOP_S
    for name, ok in met.items():
        print(f"{name}: worker-seconds and best goals {'met' if ok else 'NOT met'} on every seed")
    print("latency goals " + ("met" if latency_ok else "NOT met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
