"""The files of a job's local run directory that the worker itself touches, one function
each: the spec it writes before the launch, a sweep trial's rung plan and verdicts
(contracts/rungs.py), the markers it appends to the job log, and the size of a rank's own
events file. The run directory is the one the storage seam decided
(`torchyard.storage.run_dir`); the trainer writes the rest of it. What earlier attempts
stored (their events, the checkpoint to resume from) is read through the seam instead
(worker/supervisor.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from torchyard.storage import beneath
from torchyard.store.paths import LOG_FILE, SPEC_FILE

# The worker's own files at the top of a run directory: created by the worker, never
# handed to the sandbox's user (`worker_owned`), so a job cannot replace or write them.
_RANK_LOG = re.compile(r"^output\.rank[0-9]+\.log$")


def worker_owned(name: str) -> bool:
    """Whether `name` (top level of a run directory) is one of the worker's own files."""
    return name in (LOG_FILE, SPEC_FILE) or bool(_RANK_LOG.match(name))


def write_spec_file(run_dir: Path, spec: dict[str, Any]) -> Path:
    """The job's spec, written atomically where the trainer reads it (a fresh temporary
    name, no link followed)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    beneath.replace_file(run_dir, SPEC_FILE, json.dumps(spec, indent=2, sort_keys=True).encode())
    return run_dir / SPEC_FILE


def write_run_file(run_dir: Path, name: str, data: bytes) -> None:
    """Replace `name` at the top of the run directory atomically, following no link: the
    trainer writes in this directory too, and may have put a link or a file by that name
    there (raises OSError, e.g. when it made it a directory)."""
    beneath.replace_file(run_dir, name, data)


def remove_run_files(run_dir: Path, prefix: str, suffix: str) -> None:
    """Unlink the run directory's top-level entries named `prefix…suffix` (an earlier
    attempt's rung verdicts); links are unlinked, never followed."""
    try:
        dfd = beneath.open_dir(run_dir)
    except FileNotFoundError:
        return
    try:
        for name in os.listdir(dfd):
            if name.startswith(prefix) and name.endswith(suffix):
                try:
                    beneath.remove(dfd, name)
                except OSError:
                    continue
    finally:
        os.close(dfd)


def claim_log(path: Path) -> None:
    """Make the log at `path` a file of the worker's own before anything is appended: one
    an older release handed to the sandbox's user keeps its bytes in a fresh file; a link,
    a folder or a FIFO in its place is moved aside (raises OSError)."""
    beneath.claim_owned(path.parent, path.name)


def quoted(text: str) -> str:
    """A job-chosen string for a marker in the job log: a JSON string (ASCII, no newline)
    whose `$` and backquote are escaped too, so no shell reading the line could expand it
    (`$(…)` survives Python's repr() whenever the string holds a quote)."""
    return json.dumps(text).replace("$", "\\u0024").replace("`", "\\u0060")


def append_to_log(path: Path, text: str) -> None:
    """Append to the job log, only if it is the worker's own file (raises OSError)."""
    beneath.append_owned(path.parent, path.name, text.encode())


def file_size(path: Path) -> int:
    """Its size now; 0 when it does not exist yet (or is not a regular file)."""
    try:
        fd = beneath.open_file(path.parent, path.name)
    except (FileNotFoundError, beneath.UnsafePath):
        return 0
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
