"""The files of a job's local run directory that the worker itself touches, one function
each: the spec it writes before the launch, a sweep trial's rung plan and verdicts
(contracts/rungs.py), the markers it appends to the job log, and the size of a rank's own
events file. The run directory is the one the storage seam decided
(`torchyard.storage.run_dir`); the trainer writes the rest of it. What earlier attempts
stored (their events, the checkpoint to resume from) is read through the seam instead
(worker/supervisor.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
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


def write_run_file(run_dir: Path, name: str, data: bytes) -> None:
    """Replace `name` at the top of the run directory atomically, following no link: the
    trainer writes in this directory too, and may have put a link or a file by that name
    there (raises OSError, e.g. when it made it a directory)."""
    dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o644)  # readable by the sandbox's user, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def remove_run_files(run_dir: Path, prefix: str, suffix: str) -> None:
    """Unlink the run directory's top-level entries named `prefix…suffix` (an earlier
    attempt's rung verdicts); links are unlinked, never followed."""
    try:
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        for name in os.listdir(dfd):
            if name.startswith(prefix) and name.endswith(suffix):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                    os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


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
