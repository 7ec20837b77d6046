"""What the sandbox's zygote costs in memory: a job's sandbox, cold vs run by the zygote.

    .venv/bin/python bench/zygote_memory_bench.py [--samples 5]

One worker slot (the sandbox launcher and its warm trainer, as a worker makes them), one
long digits job at a time, measured once it has logged its first steps: the summed PSS
(proportional set size: a page shared by n processes counts 1/n to each, so the sum is
the memory the sandbox really holds) of every process in the job's sandbox, --samples
times 0.5 s apart, median. Three cases side by side: the job started cold (its own
sandbox, nothing else), the job in a fork of the zygote (the zygote idles beside it:
the warm slot's price), and the idle zygote alone between jobs. Prints each and the
zygote-run over cold ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import benchlib  # noqa: F401  (the repository root on sys.path)

from torchyard.settings import Settings
from torchyard.worker.launch_sandbox import SandboxLauncher, SandboxTrainer
from torchyard.worker.launcher import LaunchRequest
from torchyard.worker.proc import Launch, slot_env, trainer_argv
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.zygote import ZygoteTrainer, children

SPEC = {
    "model": {"name": "mlp", "hidden": [512, 512]},
    "data": {"name": "digits"},
    "optimizer": {"name": "adam", "lr": 0.001},
    "batch_size": 64,
    "epochs": 10_000,
    "log_every_steps": 5,
}


def pss_kib(pid: int) -> int:
    """`pid`'s PSS and its descendants', in KiB (0 for what is gone)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    except OSError:
        return 0
    return total + sum(pss_kib(k) for k in children(pid))


def request(settings: Settings, run: Path) -> LaunchRequest:
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps(SPEC))
    launch = Launch(spec_path=run / "spec.json", run_dir=run)
    return LaunchRequest(
        launch=launch,
        argv=trainer_argv(launch),
        env=slot_env(settings, "", {}, attempt=1),
        cwd=run,
        log_path=run / "output.log",
        warm_ok=True,
        tenant=1,
    )


def wait_steps(run: Path) -> None:
    events = run / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (events.exists() and '"metric"' in events.read_text(errors="replace")):
        if time.monotonic() > deadline:
            raise SystemExit(f"no steps in {run}: {(run / 'output.log').read_text()[-2000:]}")
        time.sleep(0.1)
    time.sleep(1.0)  # a few epochs in: its memory has grown to its working size


def sample(root_pid: int, n: int) -> float:
    values = []
    for _ in range(n):
        values.append(pss_kib(root_pid) / 1024)
        time.sleep(0.5)
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zygote-mem-") as tmp:
        settings = Settings(home=Path(tmp) / "home", storage_root=Path(tmp) / "storage")
        warm = WarmTrainer(lambda: slot_env(settings, "", {}))
        launcher = SandboxLauncher(settings, warm)
        runs = settings.storage / "jobs"
        cold = launcher.start(dataclasses.replace(request(settings, runs / "cold"), warm_ok=False))
        assert isinstance(cold, SandboxTrainer)
        wait_steps(runs / "cold")
        cold_mib = sample(cold.pid, args.samples)
        cold.kill()
        cold.wait(30)
        warm.refill()
        while not warm.ready():
            time.sleep(0.1)
        assert warm.proc is not None
        sandbox = warm.proc.pid
        idle_mib = sample(sandbox, args.samples)
        forked = launcher.start(request(settings, runs / "warm"))
        assert isinstance(forked, ZygoteTrainer)
        wait_steps(runs / "warm")
        forked_mib = sample(sandbox, args.samples)
        forked.terminate()
        forked.wait(60)
        warm.refill()
        warm.close()
    print(f"cold job's sandbox:           {cold_mib:8.1f} MiB PSS")
    print(f"idle zygote's sandbox:        {idle_mib:8.1f} MiB PSS")
    print(f"zygote + its forked job:      {forked_mib:8.1f} MiB PSS")
    print(f"zygote-run / cold:            {forked_mib / cold_mib:8.2f}x")


if __name__ == "__main__":
    main()
