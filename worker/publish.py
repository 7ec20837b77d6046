"""What a trainer writes into its run directory on this host, made durable in an object
store (a storage whose run directories are not its stored objects: `Storage.stored_run_dirs`
is False), off the training path: the trainer writes files and events locally as ever, and
the worker's threads move them.

- Checkpoints, weights and artifacts (`CheckpointUploads`): each announced file is uploaded, with the
  sha256 the trainer announced checked against the bytes sent, before its event is
  recorded, to a key that names that sha256 (`Storage.checkpoint_key`): a fenced attempt
  still uploading can never replace what a later attempt recorded under the same path. The recorder asks `ready(event)` before each commit; until every checkpoint of
  the batch is durable it holds the batch (the trainer runs on), so the store never lists a
  checkpoint the object store does not hold. A store outage only delays the record: the
  files wait on the local disk and go up when it returns. Pruned checkpoints (keep_last)
  are deleted from the store once their rows say so.
- The job log (`LogShipper`): the bytes the worker's log pump writes to the local log are
  appended to the stored log every SHIP_S, so the API serves and follows the log of a job
  on any host, and after that host is gone. Rank 0 writes `output.log`, any other rank
  its own `output.rank<R>.log`, locally and in the store (an object has one appender at a
  time, and two ranks on one host share its working copy).
- The events file (`align_events`): the store records where each job's events end (an
  offset into events.jsonl); a new host's events file is made to end there (a sparse file
  of that size) so offsets go on from the record. What a trainer wrote that its worker had
  not recorded when its host died stays on that host: lost if the host is gone, ingested
  by the next attempt if it runs there (see docs/architecture.md, the fault model).

Files are read without following a link: a sandboxed trainer writes its run directory and
could plant one (`checkpoints/step-10.pt -> /etc/shadow`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from torchyard.contracts.eventmodel import ArtifactEvent, CheckpointEvent
from torchyard.storage import Storage, UnsafePath, beneath, job_key
from torchyard.storage.base import ChecksumMismatch
from torchyard.storage.local import LocalStorage, open_regular
from torchyard.store.paths import rank_log_file

__all__ = [
    "CheckpointGone",
    "CheckpointRefused",
    "CheckpointUploads",
    "LogShipper",
    "UploadPending",
    "align_events",
    "log_key_for_rank",
]

log = logging.getLogger("torchyard.worker")

SHIP_S = 1.0  # how often a log's new bytes go to the store
SHIP_MAX = 8 << 20  # most bytes one append carries
CLOSE_WAIT_S = 30.0  # how long the last ship of a log may retry before giving up
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # backoff of a failed upload
MARKER = ".torchyard-events-attempt"  # which attempt last wrote this host's events file


class UploadPending(OSError):
    """A checkpoint of the batch is not durable in the object store yet: the batch waits
    (transient, like a store outage)."""


class CheckpointRefused(Exception):
    """A checkpoint that can never be uploaded: a link, or not the bytes its event
    announced."""


class CheckpointGone(CheckpointRefused):
    """A checkpoint whose file is no longer on this host and was never stored: keep_last
    pruned it before its upload began (a trainer that checkpoints faster than the store
    takes them), or its host is gone. Nothing is lost that a later checkpoint does not
    supersede."""


UPLOAD_NICE = 10  # the upload thread's niceness: on a busy host the trainer gets the CPU


def _yield_cpu() -> None:
    """Lower this thread's CPU priority (Linux nices threads one by one): hashing and
    sending a checkpoint must not take cycles from the training step on a full host."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)


def log_key_for_rank(job_id: str, rank: int) -> str:
    """The stored log a rank's host appends to: one appender per object."""
    return job_key(job_id, rank_log_file(rank))


@dataclass
class _Upload:
    future: Future[None]
    retry_at: float = 0.0
    failures: int = 0


class CheckpointUploads:
    """One upload thread per supervision: checkpoints go up one at a time, in the order
    their events came (a later one never overtakes, so a resume pick is never newer than
    what is durable)."""

    def __init__(self, storage: Storage, cache_root: Path, job_id: str) -> None:
        self.storage, self.job_id = storage, job_id
        self.local = LocalStorage(cache_root)  # this host's copies, read without links
        self._uploads: dict[str, _Upload] = {}
        # (sha256, bytes) of each stored checkpoint as the upload counted them: recorded
        # instead of what its event said.
        self.measured: dict[str, tuple[str, int]] = {}
        self._queue: queue.Queue[tuple[Callable[[], None], Future[None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="uploads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _yield_cpu()
        while (item := self._queue.get()) is not None:
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fn()
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def _submit(self, fn: Callable[[], None]) -> Future[None]:
        fut: Future[None] = Future()
        self._queue.put((fn, fut))
        return fut

    def ready(self, c: CheckpointEvent | ArtifactEvent) -> bool:
        """Whether `c`'s file is durable in the store (its upload is started if not).
        CheckpointRefused when it never can be; a failed upload is retried with backoff."""
        path = c.path or ""
        up = self._uploads.get(path)
        if up is None:
            up = self._uploads[path] = _Upload(self._submit(lambda: self._upload(c)))
        if not up.future.done():
            return False
        err = up.future.exception()
        if err is None:
            return True
        if isinstance(err, CheckpointRefused):
            raise err
        now = time.monotonic()
        if up.retry_at == 0.0:
            up.failures += 1
            wait = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (up.failures - 1))
            up.retry_at = now + wait
            log.warning(
                "job %s: upload of %s failed (%s); retrying in %.0fs", self.job_id, path, err, wait
            )
        if now >= up.retry_at:
            up.future, up.retry_at = self._submit(lambda: self._upload(c)), 0.0
        return False

    def _upload(self, c: CheckpointEvent | ArtifactEvent) -> None:
        if c.sha256 is None:
            raise CheckpointRefused(
                f"checkpoint {c.path!r}: announced without its sha256, which an object store "
                "names it by (torchyard.job's checkpoint() writes it)"
            )
        try:
            here = job_key(self.job_id, c.path or "")
            key = self.storage.checkpoint_key(self.job_id, c.path or "", c.sha256)
            src = self.local.open_read(here)
        except (FileNotFoundError, UnsafePath) as e:
            if self._already_stored(c):  # an earlier attempt uploaded it, unrecorded
                return
            raise CheckpointGone(
                f"checkpoint {c.path!r}: its file is not on this host ({e}), so it was never stored"
            ) from None
        with src:
            # The open file itself (no second lookup of a path a trainer could swap).
            proc = Path(f"/proc/self/fd/{src.fileno()}")
            try:
                info = self.storage.write_file(key, proc, sha256=c.sha256)
                self.measured[c.path or ""] = (info.sha256 or c.sha256, info.size)
            except ChecksumMismatch as e:
                raise CheckpointRefused(
                    f"checkpoint {c.path!r}: its file does not match the sha256 its event "
                    f"announced ({e})"
                ) from None

    def _already_stored(self, c: CheckpointEvent | ArtifactEvent) -> bool:
        try:
            key = self.storage.checkpoint_key(self.job_id, c.path or "", c.sha256 or "")
            info = self.storage.stat(key)
        except (FileNotFoundError, UnsafePath):
            return False
        # Only a checked upload writes a key that names its sha256.
        if info.sha256 not in (None, c.sha256):
            return False
        self.measured[c.path or ""] = (c.sha256 or "", info.size)
        return True

    def started(self, path: str) -> bool:
        """Whether an upload of `path` was begun (its object may exist)."""
        return path in self._uploads

    def pending(self) -> int:
        """Checkpoints not yet durable in the store (queued, going up, or waiting to be
        retried): the worker's metrics read it from another thread, hence the copy."""
        return sum(
            not (u.future.done() and u.future.exception() is None)
            for u in list(self._uploads.values())
        )

    def forget(self, paths: list[str]) -> None:
        """Recorded: their uploads are done with."""
        for p in paths:
            self._uploads.pop(p, None)
            self.measured.pop(p, None)

    def delete_pruned(self, rows: list[tuple[str, str]]) -> None:
        """keep_last pruned these (path, sha256) and their rows say so: remove the stored
        objects (in the upload thread, after any upload still queued; a failure only leaves
        an orphan)."""

        def drop() -> None:
            for p, sha in rows:
                try:
                    # an earlier release's plain key where that is what holds it
                    self.storage.delete(self.storage.recorded_file_key(self.job_id, p, sha))
                except (OSError, UnsafePath) as e:
                    log.warning("job %s: could not delete pruned %s (%s)", self.job_id, p, e)

        if rows:
            self._submit(drop)

    def close(self) -> None:
        """Stop the thread after what is queued (uploads still running finish first)."""
        self._queue.put(None)
        self._thread.join(timeout=CLOSE_WAIT_S)


class LogShipper:
    """Appends what a local log file gains to its stored object, every SHIP_S, from a
    thread. The file is opened once, without following a link, so a trainer that replaces
    it cannot make the worker ship another file."""

    def __init__(self, storage: Storage, path: Path, key: str) -> None:
        self.storage, self.key = storage, key
        # The local log continues the stored one (a sparse file of its size): offsets go on
        # from it, and the log cap (worker/logpump.py) counts every attempt's bytes.
        self._offset = _stored_size(storage, key)
        self._fd = _open_log(path, self._offset)
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="log-ship", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SHIP_S):
            self.ship()

    def ship(self) -> bool:
        """Append what is new (in bounded pieces); False when the store refused it (the
        bytes stay on the local disk for the next try)."""
        while True:
            data = os.pread(self._fd, SHIP_MAX, self._offset)
            if not data:
                return True
            try:
                self.storage.append(self.key, data)
            except OSError as e:
                if not self._warned:
                    log.warning("log %s: not shipped yet (%s); retrying", self.key, e)
                    self._warned = True
                return False
            self._offset += len(data)
            self._warned = False

    def unshipped_bytes(self) -> int:
        """Bytes of the local log not yet in the store (OSError once closed)."""
        return max(0, os.fstat(self._fd).st_size - self._offset)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """The last ship: retried until it goes or `wait_s` passes (then what is left
        stays only on this host's disk)."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + wait_s
        while not self.ship() and time.monotonic() < deadline:
            time.sleep(1.0)
        os.close(self._fd)


def _stored_size(storage: Storage, key: str) -> int:
    """How long the stored log is (0: none yet, or the store is out of reach: then this
    attempt's log starts its own count)."""
    try:
        return storage.stat(key).size
    except FileNotFoundError:
        return 0
    except (OSError, UnsafePath) as e:
        log.warning("log %s: its stored size is unknown (%s); counting from 0", key, e)
        return 0


def _open_log(path: Path, size: int) -> int:
    """The local log for this attempt: `size` bytes of holes standing for what the stored
    log already holds (nothing of an earlier attempt's local file is kept or shipped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    beneath.remove(path.parent, path.name)  # nothing of an earlier attempt's, whoever made it
    fd = beneath.open_owned(path.parent, path.name, os.O_RDWR)
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    return fd


def align_events(events: Path, attempt: int, recorded: int) -> None:
    """Before rank 0 ingests an earlier attempt's backlog: the events file on this host
    continues the record. Where the previous attempt's rank 0 ran here, the file is its own
    (with any events it wrote after the last record: the backlog). Anywhere else it is made
    to end at the recorded offset: a stale file from an older attempt is cut there (a later
    attempt elsewhere has superseded what lies past it), a missing one is a sparse file of
    that size (its bytes were recorded; only the offsets matter)."""
    marker = events.parent / MARKER
    previous = _read_marker(marker)
    if previous != attempt - 1:
        events.parent.mkdir(parents=True, exist_ok=True)
        # The trainer's own file, its recorded bytes kept: cut or extended, never a link.
        fd = beneath.open_regular_rw(events.parent, events.name, os.O_WRONLY)
        try:
            os.ftruncate(fd, recorded)
            if recorded:  # its last line ended: nothing glues onto the recorded bytes
                os.pwrite(fd, b"\n", recorded - 1)
        finally:
            os.close(fd)
    beneath.replace_file(marker.parent, marker.name, json.dumps({"attempt": attempt}).encode(),
                         mode=0o600)  # fmt: skip


def _read_marker(marker: Path) -> int | None:
    try:
        with open_regular(marker) as f:
            return int(json.loads(f.read(256))["attempt"])
    except (OSError, UnsafePath, ValueError, KeyError, TypeError):
        return None
