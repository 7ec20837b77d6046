"""The storage interface: what a backend does with stored objects (a job's checkpoints,
weights, log and events; code bundles), each named by a key relative to the storage root
(storage/keys.py), never by a user's path.

Reads take byte ranges and stream, so a 10 GB checkpoint is never one `bytes`; writes are
atomic (a reader sees the whole old object or the whole new one, never a torn one); a log
or an events file is appended to and tailed from an offset. A missing object is
`FileNotFoundError`, a refused key `UnsafePath`, whatever the backend.

Two things are about this host rather than the store: a job's *run directory*
(`run_dir`), the local working folder its trainer writes into by contract, and local paths
for what needs a real file (`local_path`: the object's own file, on a backend that has one,
which Starlette's FileResponse serves with sendfile; `local_copy`: a file holding the
object, fetched if need be). A backend whose objects are not local files uploads from the
run directory on the worker's side.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol

from torchyard.storage.keys import check_key, job_key, stored_file_key

if TYPE_CHECKING:
    from torchyard.settings import Settings

COPY_BLOCK = 1 << 20  # bytes per read when streaming from one file to another


class StorageUnavailable(OSError):
    """The store is out of reach (connection refused or timed out, a 5xx after retries):
    transient, the caller retries later. The message names the store and what failed."""


class StorageConfigError(ValueError):
    """A setting of the storage is wrong (found by `Storage.check()` at a service's start):
    the message names the setting to fix."""


class ChecksumMismatch(OSError):
    """Bytes that do not hash to the sha256 they were announced with: nothing was stored
    (a write) or kept (a copy)."""


def sha256_file(f: IO[bytes]) -> str:
    """The sha256 (hex) of what is left in an open binary file."""
    h = hashlib.sha256()
    while block := f.read(COPY_BLOCK):
        h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object as `stat` and `list` see it."""

    key: str
    size: int
    mtime: float  # seconds since the epoch
    sha256: str | None = None  # only where the backend knows it without reading the object


class Tail(Protocol):
    """An append-only object read as it grows (events.jsonl), from the offset it was
    opened at."""

    def read(self) -> bytes:
        """Everything appended since the last read; b"" when nothing was (or when the
        object does not exist yet: a later read finds it)."""
        ...

    def close(self) -> None: ...


class BoundedReader(io.RawIOBase):
    """At most `length` bytes of a binary stream, then EOF; closes the stream with it."""

    def __init__(self, raw: IO[bytes], length: int) -> None:
        super().__init__()
        self._raw, self._left = raw, max(0, length)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # any writable buffer (bytearray, memoryview)
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        data = self._raw.read(len(view))
        n = len(data)
        view[:n] = data
        self._left -= n
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        super().close()


class Storage(ABC):
    """Where stored files live. Every method takes a key (checked: storage/keys.py) and is
    safe to call from several threads at once."""

    scheme: ClassVar[str]  # the URL scheme that chooses this backend (storage/__init__.py)
    stored_run_dirs: ClassVar[bool] = False
    """True when a job's run directory IS its stored objects, so nothing needs uploading
    (the local backend); False where the run directory is this host's working copy."""

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, settings: Settings) -> Storage:
        """The backend for `url` (its scheme is `scheme`), built from the settings."""

    def check(self) -> None:
        """At a service's start: the store answers as configured. StorageConfigError naming
        the setting to fix when it does not (default: nothing to check)."""
        return None

    # ---------------------------------------------------------------- reading

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of the object; FileNotFoundError when there is none."""

    def exists(self, key: str) -> bool:
        """Whether the object is there (UnsafePath still raises: a refused key is no
        answer)."""
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    @abstractmethod
    def open_read(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        """A stream of the object's bytes from `start`, at most `length` of them (None: to
        the end); the caller closes it. FileNotFoundError when there is no object."""

    @abstractmethod
    def read_range(self, key: str, start: int, limit: int) -> tuple[bytes, int]:
        """(at most `limit` bytes from `start`, the object's size), both from one look at
        it; b"" from a `start` at or past the end. FileNotFoundError when there is none."""

    @abstractmethod
    def open_tail(self, key: str, offset: int = 0) -> Tail:
        """Read an append-only object as it grows, from byte `offset`."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key lies under the folder `prefix` ("" for all), by key."""

    # ---------------------------------------------------------------- writing

    @abstractmethod
    def write_stream(self, key: str, src: IO[bytes]) -> ObjectInfo:
        """Store everything `src` holds as the object, atomically (durable once this
        returns), replacing any object of that key."""

    def write_bytes(self, key: str, data: bytes | memoryview) -> ObjectInfo:
        """`write_stream` of `data`."""
        return self.write_stream(key, io.BytesIO(data))

    @abstractmethod
    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        """Store the local file `path` as the object, atomically. `move`: the file is
        consumed (a rename where it is on the storage's own file system, no copy).
        `sha256`: what the bytes must hash to, else ChecksumMismatch and no object is
        written. The returned ObjectInfo carries the sha256 of the bytes stored."""

    @abstractmethod
    def append(self, key: str, data: bytes) -> None:
        """Add `data` at the end of the object (created if missing): a log's lines."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the object; False when there was none."""

    # ---------------------------------------------------------------- on this host

    @abstractmethod
    def local_path(self, key: str) -> Path | None:
        """The object's own file on this host's file system (whether or not it exists
        yet), checked to stay inside its key's scope; None on a backend without one."""

    @abstractmethod
    def staging_dir(self, prefix: str) -> Path:
        """A local folder (created) for files on their way into `prefix`: on the storage's
        own file system where it has one, so `write_file(…, move=True)` is a rename."""

    @abstractmethod
    def run_dir(self, job_id: str) -> Path:
        """The job's run directory on this host: the local working folder its trainer
        writes checkpoints, weights, events and its log into (`--run-dir`)."""

    def describe(self, key: str) -> str:
        """The object's name in messages."""
        return f"{self.scheme}://{check_key(key)}"

    def checkpoint_key(self, job_id: str, relative: str, sha256: str) -> str:
        """Where a job's recorded checkpoint or weights file is stored: the run directory's
        own file where run directories are stored (`stored_run_dirs`), else the object a
        worker uploaded, named by its sha256 too (storage/keys.py `stored_file_key`)."""
        if self.stored_run_dirs:
            return job_key(job_id, relative)
        return stored_file_key(job_id, relative, sha256)

    def recorded_file_key(self, job_id: str, relative: str, sha256: str) -> str:
        """Where to READ a recorded checkpoint or weights file: `find_recorded_file`'s key,
        else `checkpoint_key` (whose absence the reader then meets)."""
        found = self.find_recorded_file(job_id, relative, sha256)
        return found if found is not None else self.checkpoint_key(job_id, relative, sha256)

    def find_recorded_file(self, job_id: str, relative: str, sha256: str) -> str | None:
        """The key holding a recorded checkpoint or weights file, None when there is none:
        `checkpoint_key`, or in an object store that holds only the plain run-directory
        key for it, that key: releases before content-named keys uploaded it there
        (nothing writes a plain key any more, so it can no longer be overwritten, and every
        reader checks the recorded sha256 as for any other). Without it an upgraded
        deployment lost every earlier checkpoint (its downloads, resumes and `init`
        weights). One HEAD when the content-named key is there."""
        key = self.checkpoint_key(job_id, relative, sha256)
        if self.exists(key):
            return key
        if self.stored_run_dirs:
            return None
        plain = job_key(job_id, relative)
        return plain if self.exists(plain) else None

    def presign(self, key: str, expires_s: int, filename: str | None = None) -> str | None:
        """A URL that GETs the object straight from the store (honouring Range) for
        `expires_s` seconds, saved as `filename` where given (Content-Disposition); None
        on a backend without one."""
        check_key(key)
        return None

    def local_copy(self, key: str, sha256: str | None = None) -> Path:
        """A local file holding the object, for what needs a path (unpacking a bundle, a
        trainer's `--init`): the object's own file where there is one, else a fresh copy
        under `staging_dir("copies")` (fetched each time, over any copy already there).
        `sha256`: what the bytes must hash to, else ChecksumMismatch and no copy is left.
        FileNotFoundError when there is no object."""
        own = self.local_path(key)
        if own is not None:
            if not own.is_file():
                raise FileNotFoundError(key)
            return own
        target = self.staging_dir("copies") / check_key(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            h = hashlib.sha256()
            with self.open_read(key) as src, open(tmp, "wb") as out:
                while block := src.read(COPY_BLOCK):
                    h.update(block)
                    out.write(block)
            if sha256 is not None and h.hexdigest() != sha256:
                raise ChecksumMismatch(
                    f"{self.describe(key)}: its bytes hash to {h.hexdigest()}, not {sha256}"
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target
