"""Training throughput inside the sandbox against the same trainer outside it, side by side.

    .venv/bin/python bench/sandbox_bench.py [--rounds 3] [--size 20000] [--epochs 2]

Runs the same job (an MLP on a synthetic data set, one CPU thread, fp32) as a real
`python -m torchyard.trainer` started by each launcher in turn, alternating, --rounds
times: `local` (TORCHYARD_SANDBOX=off: the worker's rights) and `sandbox` (bubblewrap,
worker/launch_sandbox.py). Each run's throughput is samples/s between its `started` and
`finished` events (the trainer's own clock: what the sandbox could slow down, not the
process start). Prints the medians and the ratio sandbox/local; goal: >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib  # noqa: F401  (the repository on sys.path)

from torchyard.settings import Settings
from torchyard.worker.launch_local import LocalLauncher
from torchyard.worker.launch_sandbox import SandboxLauncher
from torchyard.worker.launcher import LaunchRequest
from torchyard.worker.proc import Launch, slot_env, trainer_argv
from torchyard.worker.sandbox import support


def spec(size: int, epochs: int) -> dict[str, Any]:
    return {
        "model": {"name": "mlp", "hidden": [256, 256]},
        "data": {"name": "synthetic", "shape": [1, 28, 28], "num_classes": 10, "size": size},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "batch_size": 64,
        "epochs": epochs,
        "log_every_steps": 50,
        "checkpoint": {"every_epochs": 1, "keep_last": 1},
    }


def one_run(launcher: Any, settings: Settings, run: Path, job: dict[str, Any]) -> float:
    run.mkdir(parents=True)
    spec_path = run / "spec.json"
    spec_path.write_text(json.dumps(job))
    launch = Launch(spec_path=spec_path, run_dir=run)
    request = LaunchRequest(
        launch=launch,
        argv=trainer_argv(launch),
        env=slot_env(settings, "", {}, attempt=1),
        cwd=run,
        log_path=run / "output.log",
    )
    rc = launcher.start(request).wait(3600)
    if rc != 0:
        raise RuntimeError(f"trainer exited {rc}: {(run / 'output.log').read_text()[-2000:]}")
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    t0 = next(e["time"] for e in events if e["type"] == "started")
    t1 = next(e["time"] for e in events if e["type"] == "finished")
    samples = job["data"]["size"] * job["epochs"]
    return samples / (t1 - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=20_000)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    if not support().ok:
        print(f"this host cannot sandbox: {support().why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ty-sandbox-bench-"))
    settings = Settings(home=tmp / "home", storage_root=tmp / "storage", trainer_threads=1)
    launchers = {"local": LocalLauncher(), "sandbox": SandboxLauncher(settings, None)}
    job = spec(args.size, args.epochs)
    res: dict[str, list[float]] = {name: [] for name in launchers}
    try:
        for r in range(args.rounds):
            for name, launcher in launchers.items():
                run = settings.storage / "jobs" / f"{name}-{r}"
                res[name].append(one_run(launcher, settings, run, job))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"MLP 784-256-256-10, {args.size} samples x {args.epochs} epochs, 1 CPU thread, fp32")
    med = {k: statistics.median(v) for k, v in res.items()}
    for name, xs in res.items():
        runs = ", ".join(f"{x:.0f}" for x in xs)
        print(f"{name:>8}: median {med[name]:8.0f} samples/s   [{runs}]")
    print(f"sandbox/local throughput: {med['sandbox'] / med['local']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
