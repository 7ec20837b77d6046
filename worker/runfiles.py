"""The files of a job's local run directory that the worker itself touches, one function
each: the spec it writes before the launch, the markers it appends to the job log, and the
size of a rank's own events file. The run directory is the one the storage seam decided
(`torchyard.storage.run_dir`); the trainer writes the rest of it. What earlier attempts
stored (their events, the checkpoint to resume from) is read through the seam instead
(worker/supervisor.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchyard.store.paths import SPEC_FILE


def write_spec_file(run_dir: Path, spec: dict[str, Any]) -> Path:
    """The job's spec, written atomically where the trainer reads it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SPEC_FILE
    tmp = run_dir / f".{SPEC_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(spec, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


def append_to_log(path: Path, text: str) -> None:
    """Append to the job log (raises OSError)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def file_size(path: Path) -> int:
    """Its size now; 0 when it does not exist yet."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
