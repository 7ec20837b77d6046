"""System metrics sampler benchmark: the worker's own CPU cost of sampling one trainer.

    .venv/bin/python bench/sysmetrics_bench.py [--samples 500] [--children 4]
        [--interval-s 5] [--gpu GPU-…|0]

It starts a realistic trainer tree (a parent in its own session with `children` children,
each holding 64 MiB, as DataLoader workers or torchrun ranks would) and takes `samples`
samples of it through the worker's own code (worker/sysmetrics.py `SystemSampler.sample_once`:
the /proc scan, the tree, CPU and RSS, and with `--gpu` the four NVML readings), timing the
process CPU time (`time.process_time`) those samples cost. Prints the CPU time per sample,
the host's process count (the scan reads every /proc/PID/stat), and the cost as a fraction
of one core at the interval (default: TORCHYARD_SYS_METRICS_INTERVAL_S's default), beside
the 1 % budget. Goal: well under 1 % of one core.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from torchyard.settings import Settings
from torchyard.worker.sysmetrics import SystemSampler, scan

BUDGET = 0.01  # of one core
CHILD = "import time; b = b'1' * (64 << 20); time.sleep(3600)"
PARENT = (
    "import subprocess, sys, time\n"
    f"kids = [subprocess.Popen([sys.executable, '-c', {CHILD!r}]) for _ in range(int(sys.argv[1]))]\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)  # fmt: skip


def main() -> None:
    default_interval = Settings.model_fields["sys_metrics_interval_s"].default
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--interval-s", type=float, default=default_interval)
    ap.add_argument("--gpu", default="", help="the GPU's UUID or index (NVML readings too)")
    args = ap.parse_args()

    tree = subprocess.Popen([sys.executable, "-c", PARENT, str(args.children)],
                            stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        assert tree.stdout is not None and tree.stdout.readline().strip() == b"ready"
        time.sleep(0.5)  # the children have allocated
        clock = iter(range(1, 10**9)).__next__  # one distinct second per sample
        sampler = SystemSampler(pid=tree.pid, rank=0, gpu=args.gpu, interval_s=args.interval_s,
                                clock=clock)  # fmt: skip
        sampler._open()
        sampler.take_notes()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(args.samples):
            assert sampler.sample_once() > 0
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        rows = sampler.take()
    finally:
        tree.kill()
        tree.wait()
    rss = max(r["value"] for r in rows if r["name"] == "sys/rss_bytes")
    per_sample = cpu / args.samples
    fraction = per_sample / args.interval_s
    print(f"tree: 1 parent + {args.children} children, {rss / 2**20:.0f} MiB resident; "
          f"host processes: {len(scan())}; GPU: {args.gpu or 'none'}")  # fmt: skip
    print(f"samples: {args.samples}, series per sample: {len(rows) // args.samples}")
    print(f"CPU per sample: {per_sample * 1e3:.3f} ms (wall {wall / args.samples * 1e3:.3f} ms)")
    print(f"at one sample every {args.interval_s:g} s: {fraction * 100:.4f} % of one core "
          f"(budget {BUDGET * 100:g} %: {fraction / BUDGET:.3f}x of it)")  # fmt: skip


if __name__ == "__main__":
    main()
