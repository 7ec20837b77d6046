"""Where a job's files live under the storage root, the one check that a stored path
stays inside its job's directory (symlinks resolved) before anything opens it, and the
advisory lock files under TORCHYARD_HOME (a worker's slot, `torchyard up`'s home)."""

from __future__ import annotations

import fcntl
import re
from pathlib import Path
from typing import IO

from torchyard.contracts.eventfiles import EVENTS_FILE

__all__ = [
    "EVENTS_FILE",
    "LOG_FILE",
    "SPEC_FILE",
    "UnsafePath",
    "job_dir",
    "resolve_inside",
    "try_lock",
]

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")

SPEC_FILE = "spec.json"
LOG_FILE = "output.log"


class UnsafePath(ValueError):
    """A path that would leave the job's directory."""


def job_dir(storage_root: Path, job_id: str) -> Path:
    """`<storage>/jobs/<job_id>`: the trainer's run dir, checkpoints and the log, for all attempts."""
    if not _JOB_ID.match(job_id):
        raise UnsafePath(f"not a job id: {job_id!r}")
    return storage_root.resolve() / "jobs" / job_id


def resolve_inside(base: Path, relative: str) -> Path:
    """`base / relative`, refused if it is absolute or resolves (through `..` or a
    symlink) to anything outside `base`."""
    if not relative or Path(relative).is_absolute() or "\x00" in relative:
        raise UnsafePath(f"refused path {relative!r}")
    root = base.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise UnsafePath(f"refused path {relative!r}: outside the job directory")
    return target


def try_lock(path: Path) -> IO[str] | None:
    """An exclusive advisory lock on `path` (created if missing), held while the returned
    file stays open; the kernel drops it with the process, even on SIGKILL. None when
    another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f
