"""Checkpoint upload overhead: step throughput of one training job through a real worker
with its checkpoints going to an S3 object store (SeaweedFS), against the same job with
local-disk checkpoints, side by side in one run.

    .venv/bin/python bench/checkpoint_overhead_bench.py [--repeat 3] [--steps 400]
        [--hidden 2048,2048] [--batch-size 64] [--every 50] [--store-nice 19] [--pin-trainer]

Starts one SeaweedFS (tests/seaweed.py) and two clusters (tests/support/worker_cluster.py:
`torchyard api`, `torchyard scheduler` and one CPU worker each, SQLite + the filesystem
broker): one with the file backend (the default), one with TORCHYARD_STORAGE_URL=s3://… on
that SeaweedFS, where the worker uploads each checkpoint in a thread (worker/publish.py)
while the trainer goes on. Both stay up for the whole run (the idle one costs both the
same). Then, --repeat times, the same job on each (the order alternates, local first on
even rounds): an MLP (--hidden, default [2048, 2048]: a resume checkpoint of ~46 MB, the
weights and SGD momentum) on synthetic 1x28x28 data, --steps steps of --batch-size, a
resume checkpoint every --every steps (keep_last 2), train/loss every 10 steps.

Step throughput comes from the job's own metrics (GET /v1/jobs/{id}/metrics): each
`train/samples_per_s` point covers the steps since the previous one, so steps/s is their
steps over their summed durations (steps x batch / samples_per_s), the first window (warm-up)
left out. The windows include the trainer's own checkpoint writes (to its local run directory
in both modes) and any time the upload thread takes from it. Prints each run's steps/s and
the CPU seconds its worker (recorder, log shipping, the upload thread) and SeaweedFS
used (from /proc: load-independent, unlike steps/s), the load average, then the
median of each mode and the ratio s3/local of the medians (and of the best runs). --windows
prints every window's steps/s, and each round's own s3/local pair. Goal: ratio >= 0.97.
Before each run every worker is idle with its warm trainer ready: a worker starts its
next standby when its job ends, and that import (~5 CPU-seconds) must not overlap the
next run.

This machine may have only two cores, and the upload thread (reading, hashing, sending the
file) competes with the trainer for them: every trainer runs with one thread
(TORCHYARD_TRAINER_THREADS=1, OMP_NUM_THREADS=1), so a core is left for the worker's threads,
the services and SeaweedFS. SeaweedFS's own ingest runs on these cores too (a deployment's
store is on other hosts): an upload costs the store about 3x the worker's CPU. On a host
loaded by anything else there is no free core, and that CPU comes out of the trainer's share:
check the load average printed. --pin-trainer separates the two questions: does the loop
wait for an upload (the goal), and does the host have a core to spare for it. It gives
every trainer a core of its own (the last; they are re-pinned every 0.2 s, each thread,
since a standby trainer starts before its job) and everything else (the services, the
worker and its upload thread, SeaweedFS) the other cores, the same in both modes, as on
a GPU host whose training process has its own cores. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
from seaweed import start_seaweed
from sqlalchemy import select
from support.worker_cluster import Cluster, wait_for

from torchyard.store.models import Worker

LOG_EVERY = 10
SERVICES = {
    "TORCHYARD_TRAINER_THREADS": "1",  # one core for the trainer, one for the rest
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "2",
    "TORCHYARD_HEARTBEAT_TIMEOUT_S": "20",
}


def job_spec(hidden: list[int], steps: int, batch: int, every: int) -> dict[str, Any]:
    """The measured job: --steps steps in one epoch, a checkpoint every `every` steps."""
    return {
        "name": "ckpt-overhead",
        "model": {"name": "mlp", "hidden": hidden},
        # val_fraction 0.2 of the set is held out: the training part has `steps` batches
        "data": {
            "name": "synthetic",
            "shape": [1, 28, 28],
            "num_classes": 10,
            "size": (steps * batch * 5 + 3) // 4,
        },
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "batch_size": batch,
        "epochs": 1,
        "max_steps": steps,
        "checkpoint": {"every_steps": every, "every_epochs": None, "keep_last": 2},
        "log_every_steps": LOG_EVERY,
        "eval_every_epochs": 0,
        "seed": 1,
    }


def steps_per_s(c: Cluster, job_id: str, batch: int, verbose: bool) -> float:
    """Steps over the summed duration of the job's train/samples_per_s windows, the first
    one (warm-up) left out."""
    steps, sps = c.metrics(job_id, "train/samples_per_s")
    if len(steps) < 3:
        raise SystemExit(f"job {job_id}: only {len(steps)} train/samples_per_s points")
    n = seconds = 0.0
    for before, step, rate in zip(steps, steps[1:], sps[1:], strict=False):
        n += step - before
        seconds += (step - before) * batch / rate
    if verbose:
        print("  windows (end step: steps/s): "
              + " ".join(f"{s}:{r / batch:.1f}" for s, r in zip(steps, sps, strict=True)))  # fmt: skip
    return n / seconds


def cpu_s(pid: int) -> float:
    """CPU seconds process `pid` has used (all its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    steps_per_s: float
    checkpoints: int  # resume checkpoints listed at the end (keep_last)
    checkpoint_bytes: int  # of the last one
    worker_cpu_s: float  # the worker process: recorder, log pump, upload threads
    store_cpu_s: float  # SeaweedFS (busy in the s3 runs only)


def wait_settled(clusters: list[Cluster], timeout_s: float = 120) -> None:
    """Every cluster's worker idle with its warm trainer ready: the previous run's worker
    starts its next standby once its job ends (importing torch, ~5 CPU-seconds), which
    would otherwise overlap the next run, on the trainers' core when pinned."""
    for c in clusters:
        c.wait_workers(1)

        def warm(c: Cluster = c) -> bool:
            with c.session() as s:
                marks = list(s.scalars(select(Worker.warm_since)))
            return bool(marks) and all(m is not None for m in marks)

        wait_for(warm, timeout_s, "every worker's warm trainer", every=0.2)


def one_run(
    c: Cluster, spec: dict[str, Any], timeout_s: float, store_pid: int, verbose: bool
) -> Run:
    """The job on `c`, start to end, with the CPU its worker and the store used."""
    worker, store = cpu_s(c.procs["w0"].pid), cpu_s(store_pid)
    job = c.submit(spec)
    c.wait_state(job["id"], "succeeded", timeout=timeout_s)
    worker_after, store_after = cpu_s(c.procs["w0"].pid), cpu_s(store_pid)
    ckpts = [k for k in c.get(f"/v1/jobs/{job['id']}/checkpoints")["items"] if k["kind"] == "resume"]  # fmt: skip
    if not ckpts or not all(k["available"] for k in ckpts):
        raise SystemExit(f"job {job['id']}: checkpoints missing or unavailable: {ckpts}")
    last = max(ckpts, key=lambda k: k["step"])
    return Run(
        steps_per_s(c, job["id"], spec["batch_size"], verbose),
        len(ckpts),
        int(last["bytes"]),
        worker_after - worker,
        store_after - store,
    )


def renice_all(pid: int, nice: int) -> None:
    """Every thread of `pid` (Linux nices threads one by one; threads made later inherit)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def trainer_pids() -> list[int]:
    """Every process running a trainer (the sandbox's bwrap and what it runs included)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"torchyard.trainer" in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue  # gone meanwhile
    return pids


def pin_trainers(cpu: int, stop: threading.Event) -> None:
    """Until `stop`: every thread of every trainer onto `cpu` alone."""
    while not stop.wait(0.2):
        for pid in trainer_pids():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    if os.sched_getaffinity(int(tid)) != {cpu}:
                        os.sched_setaffinity(int(tid), {cpu})
                except OSError:
                    continue


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each mode (alternating)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--hidden", default="2048,2048", help="the MLP's hidden widths")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one job may take")
    ap.add_argument("--windows", action="store_true", help="print each run's windows")
    ap.add_argument(
        "--store-dir",
        type=Path,
        help="SeaweedFS's data folder (default: the bench's temp folder; /dev/shm keeps its "
        "writes off the disk the trainer fsyncs its checkpoints to, as a store elsewhere "
        "would)",
    )
    ap.add_argument(
        "--store-nice",
        type=int,
        default=0,
        help="run SeaweedFS at this niceness (19: as if the store were on its own hosts, as "
        "in production, so only the worker's side of an upload competes with the trainer)",
    )
    ap.add_argument(
        "--pin-trainer",
        action="store_true",
        help="give trainers the last core alone and everything else the others (both modes)",
    )
    args = ap.parse_args()
    if args.pin_trainer and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin-trainer needs at least two cores")
    if min(args.repeat, args.steps, args.batch_size, args.every) < 1:
        ap.error("--repeat, --steps, --batch-size and --every must be positive")
    if args.steps < 3 * LOG_EVERY or args.steps % LOG_EVERY:
        ap.error(f"--steps must be a multiple of {LOG_EVERY}, at least {3 * LOG_EVERY}")
    args.hidden = [int(h) for h in args.hidden.split(",")]
    return args


def main() -> int:
    args = parse_args()
    spec = job_spec(args.hidden, args.steps, args.batch_size, args.every)
    stop_pinning = threading.Event()
    if args.pin_trainer:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cpus[:-1]))  # this process and all it starts: the rest
        threading.Thread(target=pin_trainers, args=(cpus[-1], stop_pinning), daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="ckpt-overhead-bench-"))
    store_dir = (
        Path(tempfile.mkdtemp(prefix="seaweed-", dir=args.store_dir)) if args.store_dir else work
    )
    server = start_seaweed(store_dir, volume_mb=512, volumes=32)
    if args.store_nice:
        renice_all(server.process.pid, args.store_nice)
    clusters: dict[str, Cluster] = {}
    runs: dict[str, list[Run]] = {"local": [], "s3": []}
    load = os.getloadavg()[0]
    try:
        bucket = server.make_bucket("bench")
        s3_env = server.env() | {
            "TORCHYARD_STORAGE_URL": f"s3://{bucket}/ty",
            "TORCHYARD_S3_ENDPOINT_URL": server.endpoint_url,
        }
        for mode, env in (("local", {}), ("s3", s3_env)):
            (work / mode).mkdir()
            clusters[mode] = Cluster(work / mode, extra_env=SERVICES | env)
            clusters[mode].start(workers=1)
        for r in range(args.repeat):
            order = ("local", "s3") if r % 2 == 0 else ("s3", "local")
            for mode in order:
                wait_settled(list(clusters.values()))
                run = one_run(clusters[mode], spec, args.timeout, server.process.pid, args.windows)
                runs[mode].append(run)
                print(
                    f"round {r + 1} {mode:>5}: {run.steps_per_s:6.2f} steps/s   CPU s: worker "
                    f"{run.worker_cpu_s:4.1f}, SeaweedFS "
                    f"{run.store_cpu_s:4.1f}   load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        stop_pinning.set()
        for c in clusters.values():
            c.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    report(runs, args, load)
    return 0


def report(runs: dict[str, list[Run]], args: argparse.Namespace, load: float) -> None:
    last = runs["s3"][-1]
    print(benchlib.sandbox_line())
    print(
        f"mlp {args.hidden} on 1x28x28, batch {args.batch_size}, {args.steps} steps, "
        f"checkpoint every {args.every} ({last.checkpoint_bytes / 1e6:.1f} MB each, "
        f"{last.checkpoints} kept), trainer threads 1, {os.cpu_count()} cores, SeaweedFS at "
        f"nice {args.store_nice} in {args.store_dir or 'the temp folder'}, "
        f"{'trainers pinned to a core of their own, ' if args.pin_trainer else ''}"
        f"load average {load:.1f} at the start; steps/s from "
        "train/samples_per_s, first window left out"
    )
    rates = {m: [r.steps_per_s for r in rs] for m, rs in runs.items()}
    med = {m: statistics.median(xs) for m, xs in rates.items()}
    for mode, xs in rates.items():
        each = ", ".join(f"{x:.2f}" for x in xs)
        print(f"{mode:>5}: median {med[mode]:6.2f} steps/s, best {max(xs):6.2f}   [{each}]")
    print(f"ratio s3/local: median {med['s3'] / med['local']:.3f}, "
          f"best {max(rates['s3']) / max(rates['local']):.3f}   (goal >= 0.97)")  # fmt: skip
    # Each round's own pair (run back to back, the order alternating): slow drifts of the
    # host cancel out within a round.
    pairs = [s3 / local for s3, local in zip(rates["s3"], rates["local"], strict=True)]
    each = ", ".join(f"{x:.3f}" for x in pairs)
    print(f"ratio s3/local within each round: median {statistics.median(pairs):.3f}   [{each}]")


if __name__ == "__main__":
    sys.exit(main())
