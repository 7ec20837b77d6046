"""The local file system backend: every object is the file `<root>/<key>` (the root is
TORCHYARD_STORAGE_ROOT), so a job's run directory is its folder under the root itself and
nothing is copied in or out.

Every key is resolved with symlinks followed and refused (`UnsafePath`) when it lands
outside its scope (a job's folder, the bundles folder: storage/keys.py), so a stored path
or a symlink a job planted cannot reach another job's files or the host's. Writes go to a
temporary name beside the target, are fsynced, renamed over it and the folder fsynced.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, cast
from urllib.parse import unquote, urlparse

from torchyard.settings import Settings
from torchyard.storage.base import COPY_BLOCK, BoundedReader, ObjectInfo, Storage
from torchyard.storage.keys import UnsafePath, check_key, job_prefix, scope_of

__all__ = ["FileTail", "LocalStorage", "resolve_inside"]

_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


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


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_beside(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


class FileTail:
    """A local file read as it grows, from a byte offset: kept open once it exists, so each
    read is one `read` call until EOF (what the worker's event tail polls)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset = path, offset
        self._f: Any = None

    def read(self) -> bytes:
        if self._f is None:
            try:
                self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 (kept open)
            except FileNotFoundError:
                return b""
            self._f.seek(self.offset)
        out = []
        while True:
            b = self._f.read(COPY_BLOCK)
            if not b:
                break
            out.append(b)
        data = b"".join(out)
        self.offset += len(data)
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class LocalStorage(Storage):
    """Objects as files under `root`."""

    scheme = "file"

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    @classmethod
    def from_url(cls, url: str, settings: Settings) -> LocalStorage:
        """`file:///abs/path` (the root)."""
        return cls(Path(unquote(urlparse(url).path)))

    def _path(self, key: str) -> Path:
        """The file of `key`, symlinks resolved, checked to stay inside its scope."""
        clean = check_key(key)
        scope = (self.root / scope_of(clean)).resolve()
        target = (self.root / clean).resolve()
        if target != scope and scope not in target.parents:
            raise UnsafePath(f"refused path {key!r}: it resolves outside {scope_of(clean)}/")
        return target

    # ---------------------------------------------------------------- reading

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except _MISSING:
            raise FileNotFoundError(key) from None
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(key)
        return ObjectInfo(check_key(key), st.st_size, st.st_mtime)

    def _open(self, key: str) -> BinaryIO:
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115 (the caller closes it)
        except _MISSING:
            raise FileNotFoundError(key) from None
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise FileNotFoundError(key)
        return f

    def open_read(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        f = self._open(key)
        if start:
            f.seek(start)
        if length is None:
            return f
        return cast(BinaryIO, BoundedReader(f, length))

    def read_range(self, key: str, start: int, limit: int) -> tuple[bytes, int]:
        with self._open(key) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(min(start, size))
            return f.read(limit), size

    def open_tail(self, key: str, offset: int = 0) -> FileTail:
        return FileTail(self._path(key), offset)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        clean = check_key(prefix, allow_empty=True)
        found: list[ObjectInfo] = []
        stack = [clean]
        while stack:
            rel = stack.pop()
            try:
                entries = list(os.scandir(self.root / rel))
            except _MISSING:
                continue
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(key)
                elif entry.is_file(follow_symlinks=False) and not _is_temp(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return iter(sorted(found, key=lambda o: o.key))

    # ---------------------------------------------------------------- writing

    def _write_atomic(self, key: str, fill: Any) -> ObjectInfo:
        """`fill(f)` writes the content into a temporary file beside the target, which is
        then fsynced and renamed over it (the folder fsynced too)."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(target)
        try:
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)
        return self.stat(key)

    def write_stream(self, key: str, src: IO[bytes]) -> ObjectInfo:
        return self._write_atomic(key, lambda f: shutil.copyfileobj(src, f, COPY_BLOCK))

    def write_bytes(self, key: str, data: bytes | memoryview) -> ObjectInfo:
        return self._write_atomic(key, lambda f: f.write(data))

    def write_file(self, key: str, path: Path, *, move: bool = False) -> ObjectInfo:
        if not move:
            with open(path, "rb") as src:
                return self.write_stream(key, src)
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(path, target)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            info = self.write_file(key, path)  # another file system: copy, then drop it
            Path(path).unlink(missing_ok=True)
            return info
        _fsync_dir(target.parent)
        return self.stat(key)

    def append(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self._path(key))
        except _MISSING:
            return False
        return True

    # ---------------------------------------------------------------- on this host

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def staging_dir(self, prefix: str) -> Path:
        folder = self.root / check_key(prefix) / "tmp"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def run_dir(self, job_id: str) -> Path:
        return self.root / job_prefix(job_id)

    def describe(self, key: str) -> str:
        return str(self.root / check_key(key))

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"
