"""A trainer's output on its way to the job log: a pipe the worker drains on a thread of its
own, writing at most TORCHYARD_MAX_LOG_BYTES to the log. Past the cap the log gets one
marker line and the rest is read and dropped, so the job goes on (a full pipe would stall
it) and no script can fill the disk through its stdout.

Before a warm trainer has its job, its output goes to the worker's stderr (`retarget`
moves it to the job's log at the hand-over). The log is opened without following a link:
a job cannot point its log at a file of the worker's."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from torchyard.storage import beneath

CHUNK = 1 << 16


def cut_marker(max_bytes: int) -> bytes:
    return (
        f"\n[torchyard] log cut: this job's log reached {max_bytes} bytes "
        "(TORCHYARD_MAX_LOG_BYTES); further output is dropped, the job goes on\n"
    ).encode()


def open_log(path: Path) -> int:
    """The job log for appending: only a regular file of the worker's own (a link or
    another user's file: OSError)."""
    return beneath.open_owned(path.parent, path.name, os.O_WRONLY | os.O_APPEND)


class LogPump:
    """Drains `read_fd` (closed by the pump at EOF) into the job log, capped."""

    def __init__(self, read_fd: int, max_bytes: int, log_path: Path | None = None):
        self._fd = read_fd
        self._max = max_bytes
        self._lock = threading.Lock()
        self._out: int | None = None  # None: the worker's stderr
        self._left = max_bytes
        if log_path is not None:
            self.retarget(log_path)
        self._thread = threading.Thread(target=self._run, name="log-pump", daemon=True)
        self._thread.start()

    def retarget(self, log_path: Path) -> None:
        """From now on the output goes to this job log (raises OSError: no log)."""
        fd = open_log(log_path)
        size = os.fstat(fd).st_size
        with self._lock:
            self._close_out()
            self._out, self._left = fd, max(0, self._max - size)
            if self._left == 0:
                self._cut()

    def _cut(self) -> None:
        assert self._out is not None
        with contextlib.suppress(OSError):
            os.write(self._out, cut_marker(self._max))
        self._left = -1  # marked: drop the rest

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._out is None:
                with contextlib.suppress(OSError):
                    os.write(2, data)
                return
            if self._left < 0:
                return
            keep = data[: self._left]
            try:
                if keep:
                    os.write(self._out, keep)
            except OSError:
                return  # a full disk: the output is lost, never the worker
            self._left -= len(keep)
            if len(keep) < len(data):
                self._cut()

    def _run(self) -> None:
        try:
            while data := os.read(self._fd, CHUNK):
                self._write(data)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            with self._lock:
                self._close_out()

    def _close_out(self) -> None:
        if self._out is not None:
            with contextlib.suppress(OSError):
                os.close(self._out)
            self._out = None

    def join(self, timeout: float) -> None:
        """Wait for the output to be written (the trainer has exited: its pipe ends)."""
        self._thread.join(timeout)


def piped_log(max_bytes: int, log_path: Path) -> tuple[LogPump, int]:
    """A pump into `log_path` and the write end of its pipe, for a trainer's stdout (the
    caller closes it once the trainer has it). The log is opened first: one that cannot be
    opened (or is a link) raises OSError and leaves nothing open."""
    r, w = os.pipe()
    try:
        return LogPump(r, max_bytes, log_path), w
    except OSError:
        os.close(r)
        os.close(w)
        raise
