"""`torchyard slurm`: torchyard workers as Slurm jobs, one worker per Slurm job.

`torchyard slurm --workers N` submits one job array of N elements with `sbatch`; each
element asks Slurm for one GPU (`--gres=gpu:1`; `--device cpu`: CPUs only) and its batch
script `exec`s `torchyard worker`, so the worker *is* the batch step's process:

- pinned to the GPU Slurm gave it: `--gpu 0` is the first entry of the
  CUDA_VISIBLE_DEVICES Slurm sets (worker/identity.py gpu_device); where Slurm's GRES
  set none, the script sets it from SLURM_STEP_GPUS / SLURM_JOB_GPUS, and a GPU job
  with neither stops at once rather than take a card another job holds;
- named for its Slurm job, `slurm-<array job id>-<array index>` (what `squeue` shows as
  `<id>_<index>`), so a requeued element takes over its own worker row;
- configured by the environment of `torchyard slurm` itself (`--export=ALL`: the
  TORCHYARD_* settings, the same Python), which is how every other worker is set up.

When Slurm ends a worker (scancel, the time limit, a preemption) it sends SIGTERM to
every process of the job at once, the trainer (and torchrun, and bubblewrap) included,
and SIGKILL after the cluster's KillWait. The worker's own SIGTERM path drains as
everywhere (worker/node.py): the trainer checkpoints at its next step, the attempt is
handed back uncounted, the worker deregisters and exits. Two things make that hold when
the trainer hears the signal first: bubblewrap ignores SIGTERM (worker/launch_sandbox.py),
so the sandbox outlives the signal and the trainer inside can checkpoint; and a trainer
that stopped while its worker was stopping is the worker's hand-back, whichever of the
two saw the signal first (worker/supervisor.py).

A time limit (`--time`) also asks Slurm for `--signal=B:TERM@GRACE`: SIGTERM to the
worker alone GRACE seconds before the limit, so the drain starts with that much time in
hand instead of KillWait's (often 30 s). `exec` (rather than a shell that waits) is what
lets that signal reach the worker: a shell would hold it until its child ended.

Printing the script (`--print`) submits nothing; `sbatch` options this command has no
flag for go through `--sbatch-arg` (repeatable) and win over the script's own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STOP_GRACE_S = 120


@dataclass(frozen=True)
class SlurmPlan:
    """What to submit: N workers and the Slurm resources of each."""

    workers: int
    device: str  # "gpu" | "cpu"
    cpus: int
    log_dir: Path
    python: str
    partition: str | None = None
    time: str | None = None
    stop_grace_s: int = DEFAULT_STOP_GRACE_S
    job_name: str = "torchyard-worker"
    extra: list[str] = field(default_factory=list)


def _directives(p: SlurmPlan) -> list[str]:
    lines = [
        f"--job-name={p.job_name}",
        f"--array=0-{p.workers - 1}",
        "--ntasks=1",
        f"--cpus-per-task={p.cpus}",
        f"--output={p.log_dir}/%x-%A_%a.log",
        "--export=ALL",
    ]
    if p.device == "gpu":
        lines.append("--gres=gpu:1")
    if p.partition:
        lines.append(f"--partition={p.partition}")
    if p.time:
        lines += [f"--time={p.time}", f"--signal=B:TERM@{p.stop_grace_s}"]
    return [f"#SBATCH {d}" for d in lines]


_GPU_PIN = """\
# The GPU Slurm gave this job: CUDA_VISIBLE_DEVICES as Slurm set it, else its GRES ids.
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus="${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}"
  if [ -z "$gpus" ]; then
    echo "torchyard: Slurm gave job $SLURM_JOB_ID no GPU (no CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS)" >&2
    exit 1
  fi
  export CUDA_VISIBLE_DEVICES="$gpus"
fi
"""

_CPU_THREADS = """\
# A CPU slot: the trainer's threads are the CPUs Slurm gave this job.
export TORCHYARD_TRAINER_THREADS="${TORCHYARD_TRAINER_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
"""


def render_script(p: SlurmPlan) -> str:
    """The batch script of one array element."""
    pin = ["--gpu", "0"] if p.device == "gpu" else ["--device", "cpu"]
    worker = " ".join(shlex.quote(a) for a in [p.python, "-m", "torchyard", "worker", *pin])
    return "\n".join(
        [
            "#!/bin/bash",
            "# torchyard workers on Slurm (`torchyard slurm`): one worker per array element.",
            *_directives(p),
            "set -eu",
            'name="slurm-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}-${SLURM_ARRAY_TASK_ID:-0}"',
            (_GPU_PIN if p.device == "gpu" else _CPU_THREADS).rstrip("\n"),
            "# exec: the worker is the batch step itself, so `--signal=B:TERM` reaches it.",
            f'exec {worker} --name "$name"',
            "",
        ]
    )


def submit(p: SlurmPlan, sbatch: str = "sbatch") -> str:
    """sbatch the script (on stdin); the Slurm job id. RuntimeError: sbatch refused."""
    env = dict(os.environ)
    # The submitting shell's GPU list must not stand in for the one Slurm allocates.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sbatch, "--parsable", *p.extra],
        input=render_script(p),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError((out.stderr or out.stdout).strip() or f"sbatch exited {out.returncode}")
    return out.stdout.strip().split(";", 1)[0]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchyard slurm",
        description="Submit torchyard workers as Slurm jobs (an array of --workers "
        "elements, one GPU each, or CPUs with --device cpu); each runs `torchyard worker` "
        "with this shell's TORCHYARD_* settings and leaves cleanly when Slurm ends it.",
    )
    p.add_argument("--workers", type=int, default=1, help="workers (array elements; default 1)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="gpu: one GPU per worker (default); cpu: CPU partitions")  # fmt: skip
    p.add_argument("--cpus-per-worker", type=int, default=1, metavar="C",
                   help="CPUs per worker (a CPU worker's trainer threads; default 1)")  # fmt: skip
    p.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    p.add_argument("--time", help="time limit per worker, as sbatch takes it (e.g. 1-00:00:00)")
    p.add_argument("--stop-grace", type=int, default=DEFAULT_STOP_GRACE_S, metavar="S",
                   help="with --time: SIGTERM the worker S seconds before the limit "
                   f"(default {DEFAULT_STOP_GRACE_S})")  # fmt: skip
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where each worker's Slurm output goes (default: "
                   "$TORCHYARD_HOME/logs/slurm; a path every node sees)")  # fmt: skip
    p.add_argument("--python", default=sys.executable,
                   help="the Python that runs torchyard on the nodes (default: this one)")  # fmt: skip
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="an extra sbatch option, e.g. --sbatch-arg=--account=ml (repeatable)")  # fmt: skip
    p.add_argument("--print", action="store_true", help="print the batch script; submit nothing")
    p.add_argument("--parsable", action="store_true", help="print only the Slurm job id")
    return p


def _log_dir(arg: Path | None) -> Path:
    if arg is not None:
        return arg.resolve()
    from torchyard.settings import Settings

    return Settings().home.resolve() / "logs" / "slurm"


def slurm_main(argv: list[str]) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.workers < 1:
        ap.error("--workers must be >= 1")
    if a.cpus_per_worker < 1 or a.stop_grace < 1:
        ap.error("--cpus-per-worker and --stop-grace must be >= 1")
    plan = SlurmPlan(workers=a.workers, device=a.device, cpus=a.cpus_per_worker,
                     log_dir=_log_dir(a.log_dir), python=a.python, partition=a.partition,
                     time=a.time, stop_grace_s=a.stop_grace, extra=a.sbatch_arg)  # fmt: skip
    if a.print:
        print(render_script(plan), end="")
        return 0
    if shutil.which("sbatch") is None:
        print("torchyard slurm: sbatch not found (is this a Slurm login node?)", file=sys.stderr)
        return 1
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        job = submit(plan)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"torchyard slurm: sbatch: {e}", file=sys.stderr)
        return 1
    if a.parsable:
        print(job)
        return 0
    ids = ", ".join(f"slurm-{job}-{i}" for i in range(min(a.workers, 3)))
    more = ", …" if a.workers > 3 else ""
    print(f"submitted {a.workers} worker(s) as Slurm job array {job} (workers {ids}{more})")
    print(f"squeue -j {job}; scancel {job}_<index> stops one; logs in {plan.log_dir}")
    return 0
