"""Where a job's files live under the storage root, and the one check that a stored
path stays inside its job's directory (symlinks resolved) before anything opens it."""

from __future__ import annotations

import re
from pathlib import Path

from torchyard.trainer.eventfiles import EVENTS_FILE

__all__ = ["EVENTS_FILE", "LOG_FILE", "SPEC_FILE", "UnsafePath", "job_dir", "resolve_inside"]

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
