"""Starting and stopping the trainer process: argv lists (never a shell), its environment
(GPU pin, data root), its own process group, and a parent-death signal so it never
outlives the worker."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
# Secrets the trainer has no use for stay in the worker.
_SCRUB = ("TORCHYARD_DATABASE_URL", "TORCHYARD_BROKER_URL")

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux/glibc: process group kill still applies
    _libc = None


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


def trainer_argv(launch: Launch) -> list[str]:
    tail = ["-m", "torchyard.trainer", "--spec", str(launch.spec_path), "--run-dir", str(launch.run_dir)]
    if launch.resume is not None:
        tail += ["--resume", str(launch.resume)]
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


def trainer_env(
    *,
    data_root: Path,
    cuda_visible: str,
    threads: int | None = None,
    attempt: int | None = None,
    collective_timeout_s: float | None = None,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
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


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when the worker's thread that
    started it dies, and bail out if the worker is already gone."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def spawn(
    argv: list[str], *, env: dict[str, str], cwd: Path, log_fd: int
) -> subprocess.Popen[bytes]:
    """Start the trainer in its own session (so a signal reaches it and its children), its
    stdout and stderr appended straight to the job log (no copying through the worker).
    Call from the worker's main thread: the parent-death signal follows the calling thread."""
    parent = os.getpid()
    return subprocess.Popen(
        argv,
        env=env,
        cwd=str(cwd),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent),
        close_fds=True,
    )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the trainer's whole process group (torchrun and its ranks alike)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def free_port(host: str = "") -> int:
    """A port the OS says is free now (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
