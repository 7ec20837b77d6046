"""The names of a job's files in its run directory, and the advisory lock files under
TORCHYARD_HOME (a worker's slot, `torchyard up`'s home).

Where stored files live, and the check that a stored path stays inside its job's folder, is
the storage seam's (torchyard.storage): `UnsafePath`, `resolve_inside` and `job_dir` are
re-exported from it here for the callers that still name them."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from torchyard.contracts.eventfiles import EVENTS_FILE
from torchyard.storage.keys import UnsafePath
from torchyard.storage.local import LocalStorage, resolve_inside

__all__ = [
    "EVENTS_FILE",
    "LOG_FILE",
    "SPEC_FILE",
    "UnsafePath",
    "job_dir",
    "rank_log_file",
    "resolve_inside",
    "try_lock",
]

SPEC_FILE = "spec.json"
LOG_FILE = "output.log"


def rank_log_file(rank: int) -> str:
    """A rank's own log where the run directory is not shared (an object store: an object
    has one appender at a time); rank 0's is the job's log. On a shared run directory every
    rank appends to LOG_FILE."""
    return LOG_FILE if rank == 0 else f"output.rank{rank}.log"


def job_dir(storage_root: Path, job_id: str) -> Path:
    """`<storage>/jobs/<job_id>`: the run directory of a job under a local storage root
    (`LocalStorage.run_dir`; services ask `torchyard.storage.run_dir(settings, job_id)`)."""
    return LocalStorage(storage_root).run_dir(job_id)


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
