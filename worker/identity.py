"""Who a worker is: a stable id per slot (so a restarted worker re-registers its own row),
held by an advisory file lock for the process's lifetime (two processes never serve one
slot; the lock goes with the process, even on SIGKILL), and what device it drives,
found without importing torch."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from torchyard.store.paths import try_lock

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
    # What the trainer's CUDA_VISIBLE_DEVICES holds: the GPU's (or MIG instance's) UUID
    # where known, so no numbering convention can pick another card.
    visible: str | None = None

    @property
    def cuda_visible(self) -> str:
        # A CPU slot sees no GPU at all, so it can never touch one.
        if self.kind != "cuda":
            return ""
        return self.visible if self.visible is not None else str(self.gpu)


@dataclass(frozen=True)
class GpuRow:
    """One line of nvidia-smi: its index is PCI bus order."""

    index: int
    uuid: str
    name: str
    memory_bytes: int | None


def valid_id(worker_id: str) -> bool:
    return bool(_ID.match(worker_id))


def _lock(lock_dir: Path, worker_id: str) -> IO[str] | None:
    return try_lock(lock_dir / f"{worker_id}.lock")


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


def nvidia_smi_rows() -> list[GpuRow] | None:
    """The host's GPUs as nvidia-smi lists them (PCI bus order), or None without it."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,uuid,name,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            mem: int | None = int(float(parts[3])) * 1024 * 1024
        except ValueError:
            mem = None
        if parts[0].isdigit():
            rows.append(GpuRow(int(parts[0]), parts[1], parts[2], mem))
    return rows


def gpu_device(
    index: int,
    environ: Mapping[str, str] | None = None,
    smi: Callable[[], list[GpuRow] | None] = nvidia_smi_rows,
) -> Device:
    """`--gpu N`: the N-th GPU this worker may use, pinned by UUID.

    - Under an inherited CUDA_VISIBLE_DEVICES (Slurm, a container runtime) N counts its
      entries, never the host's GPUs: `--gpu 1` with `2,3` is GPU 3, not GPU 1.
    - Otherwise N is nvidia-smi's index, which is PCI bus order. CUDA numbers devices
      fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so a bare index could name another
      card than the one reported: the trainer gets the UUID (and PCI order besides).
    - MIG instances are named by UUID (`MIG-…`) in CUDA_VISIBLE_DEVICES and passed on as is.
    ValueError when N names no GPU. The worker never initialises CUDA itself."""
    env = os.environ if environ is None else environ
    inherited = env.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        entries = [e.strip() for e in inherited.split(",") if e.strip()]
        if index >= len(entries):
            raise ValueError(
                f"--gpu {index}: this worker inherits CUDA_VISIBLE_DEVICES={inherited!r}, "
                f"which lists {len(entries)} GPU(s); --gpu counts those (from 0)"
            )
        token = entries[index]
    else:
        token = str(index)
    rows = smi()
    if token.startswith("MIG-"):
        return Device("cuda", index, mig_name(token), None, visible=token)
    row = None
    if rows is not None:
        row = next((r for r in rows if token in (str(r.index), r.uuid)), None)
        if row is None and token.isdigit():
            listed = ", ".join(f"{r.index} ({r.name})" for r in rows) or "none"
            raise ValueError(f"--gpu {index}: nvidia-smi lists no GPU {token} (it lists {listed})")
    if row is None:  # no nvidia-smi (or a UUID it does not list): pass the token on as given
        return Device("cuda", index, None, None, visible=token)
    return Device("cuda", index, row.name, row.memory_bytes, visible=row.uuid)


def mig_name(uuid: str) -> str | None:
    """'<GPU name> (MIG <profile>)' from `nvidia-smi -L`, or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpu = None
    for line in out.splitlines():
        if m := re.match(r"GPU \d+: (.+?) \(UUID", line):
            gpu = m.group(1)
        elif uuid in line and (m := re.search(r"MIG (\S+)", line)):
            return f"{gpu} (MIG {m.group(1)})"
    return None


def is_loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def advertise_address(configured: str | None) -> str:
    """Where other hosts reach this one's rendezvous: TORCHYARD_ADVERTISE_ADDR, else the
    address the host name resolves to (multi-host clusters should set it)."""
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
