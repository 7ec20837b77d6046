"""What the trainer is started with: argv lists (never a shell), its environment (GPU pin,
data root, the scrubbed secrets), the go message a warm trainer (worker/standby.py) gets
instead of an argv, and a free rendezvous port. Starting and signalling the process is a
launcher's (worker/launcher.py, worker/launch_local.py)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchyard.contracts.spec import SpecError, parse_spec
from torchyard.settings import Settings

# Secrets the trainer has no use for stay in the worker: none of the worker's own TORCHYARD_*
# settings (home, database, broker, tokens) reaches a trainer; the worker sets the ones a
# trainer reads itself. The sandbox (worker/sandbox.py sandbox_env) passes an allow-list.
_SCRUB_PREFIX = "TORCHYARD_"


@dataclass(frozen=True)
class Launch:
    """What one rank runs: world_size 1 is `python -m torchyard.trainer`, more is torchrun."""

    spec_path: Path
    run_dir: Path
    resume: Path | None = None
    world_size: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    code_dir: Path | None = None  # the job's unpacked bundle (worker/inputs.py)
    init: Path | None = None  # the weights its `init` names


def _options(launch: Launch) -> list[str]:
    """The trainer's optional arguments, as absolute paths (its cwd may be the bundle)."""
    out: list[str] = []
    for flag, path in (
        ("--resume", launch.resume),
        ("--code-dir", launch.code_dir),
        ("--init", launch.init),
    ):
        if path is not None:
            out += [flag, str(path.absolute())]
    return out


def trainer_argv(launch: Launch) -> list[str]:
    tail = [
        "-m",
        "torchyard.trainer",
        "--spec",
        str(launch.spec_path.absolute()),
        "--run-dir",
        str(launch.run_dir.absolute()),
        *_options(launch),
    ]
    if launch.world_size == 1:
        # No launcher: one process less to start (dispatch latency), exact exit codes.
        return [sys.executable, *tail]
    assert launch.master_addr and launch.master_port
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun, from this interpreter
        f"--nnodes={launch.world_size}",
        f"--node-rank={launch.rank}",
        "--nproc-per-node=1",
        f"--master-addr={launch.master_addr}",
        f"--master-port={launch.master_port}",
        "--max-restarts=0",  # retries are the scheduler's, from the latest checkpoint
        *tail,
    ]


def standby_argv() -> list[str]:
    """A warm trainer: imports torch, then reads its job as one JSON line on stdin."""
    return [sys.executable, "-m", "torchyard.trainer", "--standby"]


def zygote_argv() -> list[str]:
    """A warm trainer that serves job after job, each in a fork (trainer/zygote.py)."""
    return [sys.executable, "-m", "torchyard.trainer", "--zygote"]


def go_message(launch: Launch, env: dict[str, str], log_path: Path) -> dict[str, object]:
    """What a warm trainer is told instead of trainer_argv (one rank only): the same
    arguments, its whole environment, and the job log it appends its output to."""
    assert launch.world_size == 1
    return {
        "spec": str(launch.spec_path.absolute()),
        "run_dir": str(launch.run_dir.absolute()),
        "options": _options(launch),
        "env": env,
        "log": str(log_path.absolute()),
    }


def slot_env(
    settings: Settings, cuda_visible: str, extra: dict[str, str], attempt: int | None = None
) -> dict[str, str]:
    """The trainer's environment on this worker's slot; `attempt` is the only per-job part."""
    env = trainer_env(
        data_root=settings.data,
        cuda_visible=cuda_visible,
        threads=settings.trainer_threads,
        attempt=attempt,
        collective_timeout_s=settings.collective_timeout_s,
    )
    # The trainer refuses a bundle model past the API's limit as it builds it.
    env["TORCHYARD_MAX_MODEL_PARAMS"] = str(settings.max_model_params)
    env.update(extra)
    return env


def trainer_env(
    *,
    data_root: Path,
    cuda_visible: str,
    threads: int | None = None,
    attempt: int | None = None,
    collective_timeout_s: float | None = None,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIX)}
    if attempt is not None:
        # Stamped on every event, so a later attempt's supervisor can tell this trainer's
        # lines from its own in the job's shared events.jsonl.
        env["TORCHYARD_ATTEMPT"] = str(attempt)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["TORCHYARD_DATA_ROOT"] = str(data_root)
    env["TORCHYARD_DIE_WITH_PARENT"] = "1"
    # The pin (a UUID where nvidia-smi gave one: worker/identity.py), and PCI bus order for
    # any index, so CUDA counts GPUs as nvidia-smi does.
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if collective_timeout_s is not None:
        env["TORCHYARD_COLLECTIVE_TIMEOUT_S"] = f"{collective_timeout_s:g}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port(host: str = "") -> int:
    """A port the OS says is free now on `host` (never a hard-coded one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:  # not an address of this host (a name, a NAT): any interface
            s.close()
            return free_port("") if host else 0
        return int(s.getsockname()[1])


def runs_code(spec: dict[str, Any]) -> bool:
    """Whether the job runs code its user named (a spec that does not parse: assume so)."""
    try:
        return parse_spec(spec).runs_code
    except (SpecError, ValueError):
        return True
