"""The worker's own look at a job's run directory: how many bytes it holds (against
TORCHYARD_MAX_RUN_DIR_BYTES), and whether its file system is full. A full disk is the
host's fault and hands a job back uncounted, so the worker believes a trainer that says
so (exit 5, an `error` of kind `storage_full`) only on this evidence, never on the
trainer's word: user code runs in that trainer.

Both are plain file system calls (`os.scandir` without following links, `os.statvfs`):
the watchdog's disk thread (worker/watchdog.py) calls them every few seconds while a
trainer runs, the supervisor once more when it has exited."""

from __future__ import annotations

import os
import time
from pathlib import Path

LOW_SPACE_BYTES = 64 * 1024**2  # less free than this (or LOW_SPACE_FRACTION) is full
LOW_SPACE_FRACTION = 0.01
# A look that found the file system full this long before the trainer's end still counts:
# the trainer's failed write is deleted on its way out, which frees what it held.
LOW_SPACE_RECENT_S = 60.0


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


def dir_bytes(path: Path, stop_above: int | None = None) -> int:
    """Bytes under `path` (each entry's size, or what it takes on disk where that is more;
    links not followed, entries that vanish or cannot be read skipped); the count stops
    once it passes `stop_above`."""
    total, todo = 0, [path]
    while todo:
        try:
            it = os.scandir(todo.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(Path(entry.path))
                except OSError:
                    continue
                total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
                if stop_above is not None and total > stop_above:
                    return total
    return total


def run_dir_over(path: Path, limit: int, also: tuple[Path, ...] = ()) -> str | None:
    """Why the run directory, with the other folders the job may write (`also`: its
    private `/code`), is over `limit` bytes (None: it is not)."""
    used = 0
    for folder in (path, *also):
        used += dir_bytes(folder, stop_above=limit - used)
        if used > limit:
            break
    if used <= limit:
        return None
    return (
        f"the run directory holds more than {_gib(limit)} (TORCHYARD_MAX_RUN_DIR_BYTES); "
        f"{_gib(used)} counted before the worker stopped counting"
    )


def low_space(path: Path) -> str | None:
    """What shows the file system of `path` full (None: it has room, or cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free >= max(LOW_SPACE_BYTES, LOW_SPACE_FRACTION * size):
        return None
    return f"{_gib(free)} free of {_gib(size)}"


def storage_evidence(path: Path, low_space_at: float | None) -> str | None:
    """The worker's own evidence that the run directory's file system is full: it is now,
    or a look found it so within LOW_SPACE_RECENT_S. None: the worker saw room."""
    now = low_space(path)
    if now is not None:
        return f"the worker found {now} on the run directory's file system"
    if low_space_at is not None and time.monotonic() - low_space_at <= LOW_SPACE_RECENT_S:
        ago = time.monotonic() - low_space_at
        return f"the worker found the run directory's file system full {ago:.0f}s before"
    return None


def free_description(path: Path) -> str:
    """The room the worker saw, for a reason that says why it did not believe a trainer."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"the worker could not read its file system ({e})"
    return f"{_gib(st.f_bavail * st.f_frsize)} free"
