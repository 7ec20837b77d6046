"""An in-memory backend for tests: objects are byte strings in a dict, and nothing has a
local path (`local_path` is None), so it exercises the paths a remote backend takes
(streamed downloads, fetched copies). Its run directories, staging folders and copies live
under a scratch folder of the local file system."""

from __future__ import annotations

import hashlib
import io
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, BinaryIO

from torchyard.settings import Settings
from torchyard.storage.base import ChecksumMismatch, ObjectInfo, Storage
from torchyard.storage.keys import check_key, job_prefix

__all__ = ["MemoryStorage"]


class _MemoryTail:
    def __init__(self, storage: MemoryStorage, key: str, offset: int) -> None:
        self._storage, self._key, self.offset = storage, key, offset

    def read(self) -> bytes:
        try:
            data, _ = self._storage.read_range(self._key, self.offset, 1 << 62)
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data

    def close(self) -> None:
        pass


class MemoryStorage(Storage):
    """Objects in a dict (`memory://`); `scratch` holds what must be a local folder."""

    scheme = "memory"

    def __init__(self, scratch: Path | None = None) -> None:
        self._objects: dict[str, tuple[bytearray, float]] = {}
        self._lock = threading.Lock()
        self._scratch = scratch

    @classmethod
    def from_url(cls, url: str, settings: Settings) -> MemoryStorage:
        return cls(settings.home.resolve() / "memory-storage")

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="torchyard-memory-"))
        return self._scratch

    def _get(self, key: str) -> bytes:
        with self._lock:
            found = self._objects.get(check_key(key))
            if found is None:
                raise FileNotFoundError(key)
            return bytes(found[0])

    def stat(self, key: str) -> ObjectInfo:
        clean = check_key(key)
        with self._lock:
            found = self._objects.get(clean)
            if found is None:
                raise FileNotFoundError(key)
            data, mtime = found
            return ObjectInfo(clean, len(data), mtime, hashlib.sha256(data).hexdigest())

    def open_read(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        data = self._get(key)
        end = len(data) if length is None else start + max(0, length)
        return io.BytesIO(data[start:end])

    def read_range(self, key: str, start: int, limit: int) -> tuple[bytes, int]:
        data = self._get(key)
        return data[start : start + limit], len(data)

    def open_tail(self, key: str, offset: int = 0) -> _MemoryTail:
        return _MemoryTail(self, check_key(key), offset)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        clean = check_key(prefix, allow_empty=True)
        start = f"{clean}/" if clean else ""
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(start))
        return iter([self.stat(k) for k in keys])

    def write_stream(self, key: str, src: IO[bytes]) -> ObjectInfo:
        clean = check_key(key)
        data = bytearray(src.read())
        with self._lock:
            self._objects[clean] = (data, time.time())
        return self.stat(clean)

    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        data = Path(path).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if sha256 is not None and got != sha256:
            raise ChecksumMismatch(f"{self.describe(key)}: its bytes hash to {got}, not {sha256}")
        info = self.write_bytes(key, data)
        if move:
            Path(path).unlink(missing_ok=True)
        return info

    def append(self, key: str, data: bytes) -> None:
        clean = check_key(key)
        with self._lock:
            found = self._objects.setdefault(clean, (bytearray(), 0.0))
            found[0].extend(data)
            self._objects[clean] = (found[0], time.time())

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._objects.pop(check_key(key), None) is not None

    def local_path(self, key: str) -> None:
        check_key(key)
        return None

    def staging_dir(self, prefix: str) -> Path:
        folder = self.scratch / "staging" / check_key(prefix)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def run_dir(self, job_id: str) -> Path:
        return self.scratch / "runs" / job_prefix(job_id)
