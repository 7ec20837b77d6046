"""The local file system backend: every object is the file `<root>/<key>` (the root is
TORCHYARD_STORAGE_ROOT), so a job's run directory is its folder under the root itself and
nothing is copied in or out.

No symbolic link under the root is ever followed: a job can plant links in its run
directory (an `output.log` pointing at another job's log, or at a file of the host), and
whatever points where, a key whose path has a link in it is refused (`UnsafePath`). Reads
walk from the root one folder at a time (`openat` with O_NOFOLLOW, O_NONBLOCK on the file so
a planted FIFO cannot hang a reader), so a link swapped in after a check is refused too;
only a regular file is an object. Writes check the path for links first, then go to a
temporary name beside the target, are fsynced, renamed over it and the folder fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, BinaryIO, cast
from urllib.parse import unquote, urlparse

from torchyard.settings import Settings
from torchyard.storage import beneath
from torchyard.storage.base import (
    COPY_BLOCK,
    BoundedReader,
    ChecksumMismatch,
    ObjectInfo,
    Storage,
    sha256_file,
)
from torchyard.storage.keys import UnsafePath, check_key, job_prefix

__all__ = ["FileTail", "LocalStorage", "open_regular", "resolve_inside"]

_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A folder on the way: never through a link. The file itself: never a link, and opened
# without blocking (a FIFO would wait for a writer forever), then checked to be regular.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def _link_refused(key: str) -> UnsafePath:
    return UnsafePath(f"refused path {key!r}: it goes through a symbolic link")


def open_regular(path: Path, key: str | None = None, dir_fd: int | None = None) -> BinaryIO:
    """`path` opened for reading without following a link in its last part: UnsafePath for
    a link, FileNotFoundError when it is missing or not a regular file (a folder, a FIFO)."""
    try:
        fd = os.open(path, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (dir_fd is None and os.path.islink(path)):
            raise _link_refused(key or str(path)) from None
        if isinstance(e, _MISSING):
            raise FileNotFoundError(key or str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(key or str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


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


def _verify(name: str, got: str, want: str | None) -> None:
    if want is not None and got != want:
        raise ChecksumMismatch(f"{name}: its bytes hash to {got}, not {want}")


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


MAX_TAIL_READ = 64 << 20  # bytes one FileTail.read returns at most (the rest: the next call)


class FileTail:
    """A local file read as it grows, from a byte offset: kept open once it exists, so each
    read is one `read` call until EOF (what the worker's event tail polls). A link or
    anything but a regular file in its place is never opened: it reads as not there yet.
    `opener` opens it (default: `open_regular(path)`)."""

    def __init__(
        self, path: Path, offset: int = 0, opener: Callable[[], BinaryIO] | None = None
    ) -> None:
        self.path, self.offset = path, offset
        self._opener = opener or (lambda: open_regular(path))
        self._f: Any = None
        self.more = False  # the last read stopped at MAX_TAIL_READ: there is more already

    def read(self) -> bytes:
        if self._f is None:
            try:
                self._f = self._opener()
            except (FileNotFoundError, UnsafePath):
                return b""
            self._f.seek(self.offset)
        out = []
        got = 0
        self.more = False
        while True:
            if got >= MAX_TAIL_READ:  # a file that grew by gigabytes comes in slices
                self.more = True
                break
            b = self._f.read(COPY_BLOCK)
            if not b:
                break
            out.append(b)
            got += len(b)
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
    stored_run_dirs = True

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    @classmethod
    def from_url(cls, url: str, settings: Settings) -> LocalStorage:
        """`file:///abs/path` (the root)."""
        return cls(Path(unquote(urlparse(url).path)))

    def _path(self, key: str) -> Path:
        """The file of `key` (whether or not it exists), refused when any part of it that
        exists under the root is a symbolic link (a check, then the caller's own open: the
        reads below walk with openat instead, which leaves no gap)."""
        clean = check_key(key)
        path = self.root
        for part in clean.split("/"):
            path = path / part
            try:
                mode = os.lstat(path).st_mode
            except _MISSING:
                return self.root / clean  # nothing further down exists, so no link
            if stat.S_ISLNK(mode):
                raise _link_refused(key)
        return path

    def _parent(self, key: str) -> tuple[int, str]:
        """(an open folder of the key's last part, that part): reached from the root one
        folder at a time, never through a link. The caller closes the folder."""
        *folders, name = check_key(key).split("/")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            for part in folders:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP or _is_link(part, fd):
                        raise _link_refused(key) from None
                    if isinstance(e, _MISSING):
                        raise FileNotFoundError(key) from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    # ---------------------------------------------------------------- reading

    def stat(self, key: str) -> ObjectInfo:
        folder, name = self._parent(key)
        try:
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except _MISSING:
            raise FileNotFoundError(key) from None
        finally:
            os.close(folder)
        if stat.S_ISLNK(st.st_mode):
            raise _link_refused(key)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(key)
        return ObjectInfo(check_key(key), st.st_size, st.st_mtime)

    def _open(self, key: str) -> BinaryIO:
        folder, name = self._parent(key)
        try:
            return open_regular(Path(name), key, dir_fd=folder)
        finally:
            os.close(folder)

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
        return FileTail(self._path(key), offset, opener=lambda: self._open(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        clean = check_key(prefix, allow_empty=True)
        found: list[ObjectInfo] = []
        stack = [clean]
        while stack:
            rel = stack.pop()
            try:  # by descriptor: a folder swapped for a link meanwhile is never listed
                fd = beneath.open_dir(self.root, rel)
            except (*_MISSING, UnsafePath):
                continue
            try:
                for entry in os.scandir(fd):
                    key = f"{rel}/{entry.name}" if rel else entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(key)
                    elif entry.is_file(follow_symlinks=False) and not _is_temp(entry.name):
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat(follow_symlinks=False)
                            found.append(ObjectInfo(key, st.st_size, st.st_mtime))
            finally:
                os.close(fd)
        return iter(sorted(found, key=lambda o: o.key))

    # ---------------------------------------------------------------- writing

    def _folder(self, key: str) -> tuple[int, str]:
        """(the key's folder, made where missing, by descriptor with no link on the way;
        the key's last part). The caller closes the folder."""
        *folders, name = check_key(key).split("/")
        self.root.mkdir(parents=True, exist_ok=True)  # the admin's folder, above any job's
        try:
            return beneath.open_dir(self.root, "/".join(folders), create=True), name
        except UnsafePath:
            raise _link_refused(key) from None

    def _write_atomic(self, key: str, fill: Any) -> ObjectInfo:
        """`fill(f)` writes the content into a temporary file beside the target (O_EXCL, in
        the target's folder by descriptor), which is then fsynced and renamed over it (the
        folder fsynced too)."""
        folder, name = self._folder(key)
        tmp = f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            if _is_link(name, folder):  # refused, as a read would be (the rename replaces it)
                raise _link_refused(key)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
            with os.fdopen(os.open(tmp, flags, 0o644, dir_fd=folder), "wb") as f:
                try:
                    fill(f)
                    f.flush()
                    os.fsync(f.fileno())
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=folder)
                    raise
            beneath.rename_over(folder, tmp, name)
            os.fsync(folder)
        finally:
            os.close(folder)
        return self.stat(key)

    def write_stream(self, key: str, src: IO[bytes]) -> ObjectInfo:
        return self._write_atomic(key, lambda f: shutil.copyfileobj(src, f, COPY_BLOCK))

    def write_bytes(self, key: str, data: bytes | memoryview) -> ObjectInfo:
        return self._write_atomic(key, lambda f: f.write(data))

    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        if not move:
            return self._copy_in(key, path, sha256)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            got = sha256_file(f)
        _verify(self.describe(key), got, sha256)
        folder, name = self._folder(key)
        try:
            os.rename(path, name, dst_dir_fd=folder)
            os.fsync(folder)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            info = self._copy_in(key, path, got)  # another file system: copy, then drop it
            Path(path).unlink(missing_ok=True)
            return info
        finally:
            os.close(folder)
        return replace(self.stat(key), sha256=got)

    def _copy_in(self, key: str, path: Path, sha256: str | None) -> ObjectInfo:
        """`path`'s bytes copied into the object, hashed on the way and checked against
        `sha256` before the rename (a mismatch leaves the old object, or none)."""
        h = hashlib.sha256()

        def fill(f: IO[bytes]) -> None:
            with open(path, "rb") as src:
                while block := src.read(COPY_BLOCK):
                    h.update(block)
                    f.write(block)
            _verify(self.describe(key), h.hexdigest(), sha256)

        return replace(self._write_atomic(key, fill), sha256=h.hexdigest())

    def append(self, key: str, data: bytes) -> None:
        folder, name = self._folder(key)
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=folder)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(key) from None
            raise
        finally:
            os.close(folder)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO in its place: never written
            os.close(fd)
            raise _link_refused(key)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def delete(self, key: str) -> bool:
        try:
            folder, name = self._parent(key)
        except FileNotFoundError:
            return False
        try:
            os.unlink(name, dir_fd=folder)
        except _MISSING:
            return False
        finally:
            os.close(folder)
        return True

    # ---------------------------------------------------------------- on this host

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def local_copy(self, key: str, sha256: str | None = None) -> Path:
        """The object's own file (no copy); with `sha256`, checked to hash to it first."""
        path = self._path(key)
        with self._open(key) as f:
            if sha256 is not None:
                _verify(self.describe(key), sha256_file(f), sha256)
        return path

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
