"""Who a worker is: a stable id per slot (so a restarted worker re-registers its own row),
held by an advisory file lock for the process's lifetime (two processes never serve one
slot; the lock goes with the process, even on SIGKILL), and what device it drives,
found without importing torch."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
MAX_CPU_SLOTS = 1024


class SlotTaken(RuntimeError):
    """Another live process already serves this worker id."""


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" | "cpu"
    gpu: int | None
    name: str | None
    memory_bytes: int | None

    @property
    def cuda_visible(self) -> str:
        # A CPU slot sees no GPU at all, so it can never touch one.
        return str(self.gpu) if self.gpu is not None else ""


def valid_id(worker_id: str) -> bool:
    return bool(_ID.match(worker_id))


def _lock(lock_dir: Path, worker_id: str) -> IO[str] | None:
    lock_dir.mkdir(parents=True, exist_ok=True)
    f = open(lock_dir / f"{worker_id}.lock", "a+")  # noqa: SIM115 (held for the process life)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def claim_id(lock_dir: Path, *, name: str | None, gpu: int | None) -> tuple[str, IO[str]]:
    """The worker's id and its held lock: `name` if given, `<host>-gpu<N>` for a GPU, else
    the lowest free `<host>-cpu<K>`."""
    host = socket.gethostname().split(".")[0] or "host"
    if name is not None or gpu is not None:
        wid = name if name is not None else f"{host}-gpu{gpu}"
        if not valid_id(wid):
            raise ValueError(f"worker id {wid!r}: use letters, digits, '.', '_' and '-'")
        f = _lock(lock_dir, wid)
        if f is None:
            raise SlotTaken(f"another worker on this host already runs as {wid!r}")
        return wid, f
    for k in range(MAX_CPU_SLOTS):
        wid = f"{host}-cpu{k}"
        f = _lock(lock_dir, wid)
        if f is not None:
            return wid, f
    raise SlotTaken("no free CPU worker slot")


def cpu_device() -> Device:
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return Device("cpu", None, name, mem)


def gpu_device(index: int) -> Device:
    """Name and memory from nvidia-smi (the worker never initialises CUDA itself)."""
    name, mem = None, None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={index}",
                "--query-gpu=name,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        n, m = out.rsplit(",", 1)
        name, mem = n.strip(), int(float(m)) * 1024 * 1024
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return Device("cuda", index, name, mem)


def advertise_address(configured: str | None) -> str:
    """Where other hosts reach this one's rendezvous: TORCHYARD_ADVERTISE_ADDR, else the
    address the host name resolves to (multi-host clusters should set it)."""
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
