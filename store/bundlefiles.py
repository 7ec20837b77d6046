"""Code bundles: a user's gzip-compressed tar of their code, checked when it is uploaded
(the API) and unpacked once per bundle and host into a cache (the worker). The archive is
the stored object `bundles/<id>.tar.gz` (`archive_key`); it is read and written through the
storage seam, and checked and unpacked here as a local file.

Nothing here trusts the archive. `check_archive` streams through it within the limits (a gzip
bomb stops at the first member over them) and refuses every name or member type that could
write or link outside the bundle, or shadow our own `torchyard` package on a job's sys.path.

Python's tarfile reads a pax header or a GNU long name whole into memory before it looks at
it, so the member limits alone do not bound memory: a 255 KB gzip can hold one 250 MB pax
header. Every header is checked as tarfile reads it (`_GuardedTar`, `_HeaderBudget`), before
tarfile reads what it announces: extended headers of at most MAX_EXT_HEADER bytes, at most
MAX_EXT_CHAIN of them before one member, MAX_EXT_TOTAL bytes in the whole archive (global
ones MAX_GLOBAL_PAX), and no sparse files. Names are bounded too: MAX_NAME_BYTES a path,
MAX_COMPONENT_BYTES a part of it, MAX_NAMES_BYTES all of them (the names file kept beside
the archive), no control characters.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import secrets
import shutil
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.machinery import all_suffixes
from pathlib import Path
from typing import IO, Any, cast

from torchyard.storage import Storage
from torchyard.storage.keys import bundle_key, is_bundle_id

__all__ = [
    "MARKER",
    "BundleRejected",
    "Manifest",
    "archive_key",
    "archive_path",
    "check_archive",
    "is_bundle_id",
    "names_key",
    "sha256_file",
    "unpack_cached",
    "unpack_stored",
]

MARKER = ".torchyard-bundle.json"  # written last into an unpacked tree: "this one is complete"
_MARKER_VERSION = 1
OLD_TREES_KEEP_S = 86_400.0  # a replaced tree outlives any job still running from it
# What the decompressed stream may hold beyond the members' data: tarfile reads pax and
# GNU long-name records whole into memory, so member sizes alone do not bound it.
_HEADER_ALLOWANCE = 8192  # per member: header, pax records, padding to 512
_STREAM_SLACK = 1 << 20  # end-of-archive blocks and record padding
# A top-level name Python would import as `torchyard` from the job's cwd.
_SHADOWING = frozenset({"torchyard", *(f"torchyard{suffix}" for suffix in all_suffixes())})
_KINDS = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
}
_OTHER_KINDS = {
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}
_MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit
# Extended headers (pax records, GNU long names and link names): what tarfile may read.
MAX_EXT_HEADER = 16 * 1024  # one header's data: a long path or link and its pax records
MAX_EXT_CHAIN = 4  # extended headers in a row before one member (pax, long name, long link)
MAX_EXT_TOTAL = 8 * 1024**2  # every extended header of the archive together
MAX_GLOBAL_PAX = 4096  # global pax headers (`git archive` writes one: its commit id)
MAX_PAX_RECORDS = 64  # pax records applying to one member (each is kept with it)
_EXT_TYPES = {
    tarfile.XHDTYPE: "an extended (pax) header",
    tarfile.SOLARIS_XHDTYPE: "an extended (pax) header",
    tarfile.XGLTYPE: "a global (pax) header",
    tarfile.GNUTYPE_LONGNAME: "a GNU long name",
    tarfile.GNUTYPE_LONGLINK: "a GNU long link name",
}
# Names: the kernel's PATH_MAX and NAME_MAX, and all of a bundle's names together (the
# names file kept beside the archive: store/bundles.py).
MAX_NAME_BYTES = 4096
MAX_COMPONENT_BYTES = 255
MAX_NAMES_BYTES = 2 * 1024**2
_CONTROL = frozenset(map(chr, [*range(32), 127]))


class BundleRejected(ValueError):
    """An archive that is no acceptable bundle; `reason` says why, naming the member."""

    def __init__(self, reason: str, status: int = 422) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Manifest:
    files: int  # regular files (hardlinks included: they unpack as files)
    bytes: int  # sum of all members' sizes
    names: list[str]  # the regular files' posix paths relative to the bundle, sorted


def archive_key(bundle_id: str) -> str:
    """`bundles/<id>.tar.gz`, the archive's storage key; the id is its sha256 (lowercase
    hex; anything else: ValueError)."""
    return bundle_key(bundle_id, ".tar.gz")


def names_key(bundle_id: str) -> str:
    """`bundles/<id>.files.json`: the key of the list of the archive's file names."""
    return bundle_key(bundle_id, ".files.json")


def archive_path(storage: Path, bundle_id: str) -> Path:
    """`<storage>/bundles/<id>.tar.gz`: the archive's file under a local storage root (for
    callers that still take the root; the rest use `archive_key`)."""
    return storage / archive_key(bundle_id)


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_id(bundle_id: str) -> None:
    bundle_key(bundle_id)  # ValueError (UnsafePath) for anything but a sha256


def _reject(name: str, why: str) -> BundleRejected:
    shown = name if len(name) <= 200 else name[:200] + "…"
    return BundleRejected(f"member {shown!r}: {why}")


# ---------------------------------------------------------------- reading the stream


class _CappedReader:
    """The decompressed stream, refused past `cap` bytes; decompression errors become
    BundleRejected here, so that OSError from elsewhere (a full disk) stays what it is."""

    def __init__(self, raw: gzip.GzipFile, cap: int) -> None:
        self._raw = raw
        self._left = cap
        self._cap = cap

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > self._left + 1:
            size = self._left + 1
        try:
            data = self._raw.read(size)
        except (OSError, EOFError, zlib.error) as e:
            raise BundleRejected(f"not a valid gzip-compressed tar: {e}") from e
        self._left -= len(data)
        if self._left < 0:
            raise BundleRejected(f"the archive unpacks to more than {self._cap} bytes")
        return data

    def drain(self) -> None:
        """Read to the end, so a truncated or corrupt gzip trailer is seen too."""
        while self.read(1 << 16):
            pass


@dataclass
class _HeaderBudget:
    """What the archive's extended headers used so far; `check` refuses one over a limit
    before tarfile reads its data."""

    chain: int = 0
    total: int = 0
    global_total: int = 0

    def check(self, info: tarfile.TarInfo) -> None:
        what = _EXT_TYPES.get(info.type)
        if info.type == tarfile.GNUTYPE_SPARSE:  # its extension blocks are read unbounded
            raise BundleRejected(f"member {info.name!r}: a sparse file, not allowed")
        if what is None:
            self.chain = 0
            return
        self.chain += 1
        self.total += info.size
        if info.type == tarfile.XGLTYPE:
            self.global_total += info.size
        if info.size > MAX_EXT_HEADER:
            raise BundleRejected(f"{what} of {info.size} bytes (at most {MAX_EXT_HEADER})")
        if self.chain > MAX_EXT_CHAIN:
            raise BundleRejected(f"more than {MAX_EXT_CHAIN} extended headers in a row")
        if self.total > MAX_EXT_TOTAL:
            raise BundleRejected(f"extended headers of more than {MAX_EXT_TOTAL} bytes in all")
        if self.global_total > MAX_GLOBAL_PAX:
            raise BundleRejected(f"global pax headers of more than {MAX_GLOBAL_PAX} bytes")


class _GuardedInfo(tarfile.TarInfo):
    """A TarInfo whose processing (tarfile's documented hook, `_proc_member`) first checks
    the header against the archive's budget: tarfile reads an extended header's data whole,
    and follows a chain of them by recursion."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        budget = getattr(tar, "budget", None)
        if isinstance(budget, _HeaderBudget):
            budget.check(self)
        return super()._proc_member(tar)  # type: ignore[misc]


class _GuardedTar(tarfile.TarFile):
    """A TarFile that reads its members as `_GuardedInfo`, with one budget per archive."""

    tarinfo = _GuardedInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.budget = _HeaderBudget()
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def _open_stream(
    path: Path, *, max_files: int, max_bytes: int
) -> Iterator[tuple[tarfile.TarFile, _CappedReader]]:
    cap = max_bytes + (max_files + 1) * _HEADER_ALLOWANCE + _STREAM_SLACK
    with path.open("rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        reader = _CappedReader(gz, cap)
        try:
            # A stream read front to back ("r|"): tarfile calls only `read` on it.
            with _GuardedTar.open(fileobj=cast(IO[bytes], reader), mode="r|") as tar:
                yield tar, reader
        except tarfile.TarError as e:
            raise BundleRejected(f"not a valid gzip-compressed tar: {e}") from e


# ---------------------------------------------------------------- checking members


def _clean_name(raw: str, *, what: str, member: str) -> str:
    """`raw` as a posix path relative to the bundle (no `.` or empty parts); refused when
    absolute, with a `..` part, a NUL, a backslash or a control character, or too long."""
    if "\x00" in raw or "\\" in raw:
        raise _reject(member, f"{what} with a NUL or backslash")
    if not _CONTROL.isdisjoint(raw):
        raise _reject(member, f"{what} with a control character")
    if raw.startswith("/"):
        raise _reject(member, f"{what} is an absolute path")
    try:
        size = len(raw.encode())
    except UnicodeEncodeError:  # tarfile keeps undecodable bytes as lone surrogates
        raise _reject(member, f"{what} that is not UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise _reject(member, f"{what} longer than {MAX_NAME_BYTES} bytes")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _reject(member, f"{what} is a path outside the bundle (a '..' part)")
    if any(len(p.encode()) > MAX_COMPONENT_BYTES for p in parts):
        raise _reject(member, f"{what} with a part longer than {MAX_COMPONENT_BYTES} bytes")
    return "/".join(parts)


def _escapes(start: list[str], target: str, links: dict[str, str]) -> bool:
    """Whether `target`, read from directory `start`, resolves outside the bundle root,
    following the bundle's own symlinks as the kernel would (loops count as escapes)."""
    todo = target.split("/")[::-1]
    out = list(start)
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                return True
            out.pop()
            continue
        out.append(part)
        link = links.get("/".join(out))
        if link is not None:
            hops += 1
            if hops > _MAX_LINK_HOPS or link.startswith("/"):
                return True
            out.pop()
            todo.extend(link.split("/")[::-1])
    return False


@dataclass
class _Seen:
    """What the stream held so far, checked member by member and then as a whole."""

    max_files: int
    max_bytes: int
    count: int = 0
    total: int = 0
    names_bytes: int = 0  # every member's name and link target, as UTF-8
    kinds: dict[str, str] = field(default_factory=dict)
    files: set[str] = field(default_factory=set)
    links: dict[str, str] = field(default_factory=dict)

    def add(self, member: tarfile.TarInfo) -> None:
        raw = member.name
        self.count += 1
        if self.count > self.max_files:
            raise _reject(raw, f"more than {self.max_files} entries in the bundle")
        if not raw:
            raise _reject(raw, "an empty name")
        kind = _KINDS.get(member.type)
        if kind is None or member.issparse():
            what = _OTHER_KINDS.get(member.type, f"of tar type {member.type!r}")
            what = "a sparse file" if member.issparse() else what
            raise _reject(raw, f"{what}, not a regular file, directory or link")
        self.total += member.size
        if self.total > self.max_bytes:
            raise _reject(raw, f"the bundle unpacks to more than {self.max_bytes} bytes")
        name = _clean_name(raw, what="a path", member=raw)
        self._count_name(raw, name, member.linkname if kind in ("symlink", "hardlink") else "")
        if len(member.pax_headers) > MAX_PAX_RECORDS:
            raise _reject(raw, f"more than {MAX_PAX_RECORDS} pax records")
        if not name:
            if kind != "dir":
                raise _reject(raw, "an empty name")
            return  # "./": the bundle root itself
        self._check_name(raw, name, kind)
        if kind == "symlink":
            self._add_symlink(raw, name, member.linkname)
        elif kind == "hardlink":
            self._add_hardlink(raw, member.linkname)
        if kind in ("file", "hardlink"):
            self.files.add(name)
        self.kinds[name] = kind

    def _count_name(self, raw: str, name: str, target: str) -> None:
        self.names_bytes += len(name.encode()) + len(target.encode(errors="surrogateescape"))
        if self.names_bytes > MAX_NAMES_BYTES:
            raise _reject(raw, f"the bundle's names take more than {MAX_NAMES_BYTES} bytes")

    def _check_name(self, raw: str, name: str, kind: str) -> None:
        top = name.split("/")[0]
        if top in _SHADOWING:
            raise _reject(raw, "shadows torchyard's own package (a top-level 'torchyard')")
        if name == MARKER:
            raise _reject(raw, "a name reserved for torchyard's completion marker")
        before = self.kinds.get(name)
        if before is not None and not (before == kind == "dir"):
            raise _reject(raw, "appears twice in the bundle")

    def _add_symlink(self, raw: str, name: str, target: str) -> None:
        if not target or "\x00" in target:
            raise _reject(raw, "a symlink with an empty or NUL target")
        if len(target) > MAX_NAME_BYTES:
            raise _reject(raw, f"a symlink target longer than {MAX_NAME_BYTES} characters")
        if target.startswith("/"):
            raise _reject(raw, f"a symlink to the absolute path {target!r}")
        start = name.split("/")[:-1]
        if _escapes(start, target, {}):
            raise _reject(raw, f"a symlink to {target!r}, outside the bundle")
        self.links[name] = target

    def _add_hardlink(self, raw: str, target: str) -> None:
        if target.startswith("/"):
            raise _reject(raw, f"a hardlink to the absolute path {target!r}")
        clean = _clean_name(target, what="a hardlink target", member=raw)
        if self.kinds.get(clean) not in ("file", "hardlink"):
            raise _reject(raw, f"a hardlink to {target!r}, not a regular file before it")

    def finish(self) -> Manifest:
        """The whole-bundle checks: nothing lies beneath a file or a symlink (which would
        write through it), and no symlink resolves outside through other symlinks."""
        for name in self.kinds:
            parts = name.split("/")
            for i in range(1, len(parts)):
                prefix = "/".join(parts[:i])
                kind = self.kinds.get(prefix, "dir")
                if kind != "dir":
                    raise _reject(name, f"lies beneath {prefix!r}, a {kind}")
        for name, target in self.links.items():
            if _escapes(name.split("/")[:-1], target, self.links):
                raise _reject(name, f"a symlink to {target!r}, resolving outside the bundle")
        return Manifest(files=len(self.files), bytes=self.total, names=sorted(self.files))


def check_archive(path: Path, *, max_files: int, max_bytes: int) -> Manifest:
    """What the bundle at `path` holds, or BundleRejected (status 422) for anything hostile
    or malformed. Streams: stops at the first member over `max_files` or `max_bytes`."""
    seen = _Seen(max_files=max_files, max_bytes=max_bytes)
    with _open_stream(path, max_files=max_files, max_bytes=max_bytes) as (tar, reader):
        for member in tar:
            seen.add(member)
        reader.drain()
    return seen.finish()


# ---------------------------------------------------------------- the per-host cache


def _is_ignorable(path: str, entry: os.DirEntry[str], known: dict[str, Any]) -> bool:
    """What Python itself may add to a tree it imports from, and the marker."""
    if path == MARKER:
        return True
    if entry.name == "__pycache__" and entry.is_dir(follow_symlinks=False):
        return path not in known["dirs"]
    if entry.name.endswith(".pyc") and entry.is_file(follow_symlinks=False):
        return path not in known["files"]
    return False


def _inventory(tree: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    """Every entry under `tree`: files with [size, sha256], symlinks with their targets,
    directories, and anything else. With `known` (a marker's inventory), Python's own
    additions that the bundle did not hold are left out."""
    files: dict[str, list[Any]] = {}
    links: dict[str, str] = {}
    dirs: list[str] = []
    other: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(tree / rel) as entries:
            for entry in entries:
                path = f"{rel}/{entry.name}" if rel else entry.name
                if known is not None and _is_ignorable(path, entry, known):
                    continue
                if entry.is_symlink():
                    links[path] = os.readlink(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    dirs.append(path)
                    stack.append(path)
                elif entry.is_file(follow_symlinks=False):
                    size = entry.stat(follow_symlinks=False).st_size
                    files[path] = [size, sha256_file(Path(entry.path))]
                else:
                    other.append(path)
    return {"files": files, "links": links, "dirs": sorted(dirs), "other": sorted(other)}


def _cache_intact(tree: Path, bundle_id: str) -> bool:
    """Whether `tree` holds every entry of the bundle unmodified (what the marker lists).
    What jobs added beside them (their cwd is this tree) is left alone: it does not change
    what the bundle's own modules are. Hashes every bundle file on each call: about 1 ms
    per MB, fine for bundles of a few MB (code, not data)."""
    marker = tree / MARKER
    if tree.is_symlink() or not tree.is_dir() or marker.is_symlink():
        return False
    try:
        saved = json.loads(marker.read_text())
        if saved.get("version") != _MARKER_VERSION or saved.get("id") != bundle_id:
            return False
        for rel in saved["dirs"]:
            if (tree / rel).is_symlink() or not (tree / rel).is_dir():
                return False
        for rel, target in saved["links"].items():
            if not (tree / rel).is_symlink() or os.readlink(tree / rel) != target:
                return False
        for rel, (size, digest) in saved["files"].items():
            path = tree / rel
            if path.is_symlink() or not path.is_file() or path.stat().st_size != size:
                return False
            if sha256_file(path) != digest:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_marker(tree: Path, bundle_id: str) -> None:
    saved = {"version": _MARKER_VERSION, "id": bundle_id, **_inventory(tree, None)}
    del saved["other"]  # none: the check refused every other kind of member
    (tree / MARKER).write_text(json.dumps(saved, sort_keys=True))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _swap_in(tmp: Path, final: Path) -> None:
    """Put `tmp` at `final`. A stale `final` (a bundle file changed under it) is renamed
    away, not deleted: a job running from it may still import from it. Such trees are
    swept once a day old (`_sweep`)."""
    if os.path.lexists(final):
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        os.rename(final, old)
        with contextlib.suppress(OSError):
            os.utime(old)  # its age counts from now
    os.rename(tmp, final)


def _sweep(cache_root: Path, bundle_id: str) -> None:
    """Remove a crash's temporary trees, and replaced trees older than OLD_TREES_KEEP_S."""
    for stale in cache_root.glob(f".tmp-{bundle_id}-*"):
        _remove(stale)  # under the lock nobody else unpacks this id here
    now = time.time()
    for old in cache_root.glob(f".old-{bundle_id}-*"):
        with contextlib.suppress(OSError):
            if now - old.lstat().st_mtime > OLD_TREES_KEEP_S:
                _remove(old)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, between processes and between threads alike (each
    open() is its own open file description); the kernel drops it if we die."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def unpack_cached(
    archive: Path, bundle_id: str, cache_root: Path, *, max_files: int, max_bytes: int
) -> Path:
    """`cache_root/<bundle_id>`, holding the bundle unpacked: reused while its marker and
    content check hold, else checked and unpacked afresh and swapped in atomically."""
    return _unpack(lambda: archive, bundle_id, cache_root, max_files=max_files, max_bytes=max_bytes)


def unpack_stored(
    storage: Storage, bundle_id: str, cache_root: Path, *, max_files: int, max_bytes: int
) -> Path:
    """`unpack_cached` of the stored archive, which is read (fetched to this host, where
    the backend is not local) only when the cached tree must be unpacked afresh.
    FileNotFoundError when it is not in storage."""
    key = archive_key(bundle_id)
    return _unpack(
        lambda: storage.local_copy(key, sha256=bundle_id),  # the id is the archive's sha256
        bundle_id,
        cache_root,
        max_files=max_files,
        max_bytes=max_bytes,
    )


def _unpack(
    archive_of: Callable[[], Path],
    bundle_id: str,
    cache_root: Path,
    *,
    max_files: int,
    max_bytes: int,
) -> Path:
    """The cached tree, checked; `archive_of()` (the archive as a local file) is called
    only when it has to be unpacked afresh."""
    _check_id(bundle_id)
    cache_root.mkdir(parents=True, exist_ok=True)
    final = cache_root / bundle_id
    with _locked(cache_root / f".lock-{bundle_id}"):
        if _cache_intact(final, bundle_id):
            return final
        _sweep(cache_root, bundle_id)
        archive = archive_of()
        if sha256_file(archive) != bundle_id:
            raise BundleRejected("archive content does not match its id")
        check_archive(archive, max_files=max_files, max_bytes=max_bytes)
        tmp = cache_root / f".tmp-{bundle_id}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            with _open_stream(archive, max_files=max_files, max_bytes=max_bytes) as (tar, _):
                tar.errorlevel = 2  # every extraction problem raises
                tar.extractall(tmp, filter="data")  # belt and braces after check_archive
            _write_marker(tmp, bundle_id)
            _swap_in(tmp, final)
        finally:
            _remove(tmp)  # gone already once swapped in
    return final
