"""Packing a user's code directory into a bundle: a gzip-compressed tar that is the same bytes
(and so the same sha256, the bundle's id) for the same tree, wherever and whenever it is packed.

Reproducible because every member is written from scratch (sorted names, mtime 0, owner 0,
no user names, modes 0o755/0o644) and the gzip header carries no time and no file name. Same
bytes assumes the same zlib: another zlib build may compress differently.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from importlib.machinery import all_suffixes
from pathlib import Path

import pathspec

from torchyard.client.errors import TorchyardError

__all__ = ["IGNORE_FILE", "PackError", "Packed", "bundle_id", "pack", "pack_summary"]

IGNORE_FILE = ".torchyardignore"
_ALWAYS_SKIPPED = frozenset({".git", "__pycache__", ".venv"})
_SKIPPED_SUFFIXES = (".pyc",)
# The server refuses these top-level names: they would shadow torchyard's own package (or be
# mistaken for its completion marker in the worker's unpacked copy).
_RESERVED = frozenset(
    {"torchyard", ".torchyard-bundle.json", *(f"torchyard{s}" for s in all_suffixes())}
)


class PackError(TorchyardError, ValueError):
    """A directory that cannot be packed into a bundle."""

    is_user_error = True


@dataclass(frozen=True)
class _Entry:
    name: str  # posix, relative to the bundle root
    path: Path
    kind: str  # "dir", "file" or "symlink"
    mode: int = 0o644
    target: str = ""  # a symlink's


@dataclass(frozen=True)
class Packed:
    """What a bundle holds, for the user to see before it goes up: the file count, their
    bytes before compression, the largest few, and the top names left out."""

    files: int
    raw_bytes: int
    largest: tuple[tuple[str, int], ...]
    left_out: tuple[str, ...]


def pack_summary(directory: Path, data: bytes, shown: int = 3) -> Packed:
    """The summary of `pack(directory)` (`data`): read from the archive itself, so it says
    what was packed, not what a second walk would find."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        sizes = [(m.name, m.size) for m in tar.getmembers() if m.isfile()]
    packed_top = {name.split("/", 1)[0] for name, _ in sizes}
    try:
        with os.scandir(directory) as it:
            tops = sorted(e.name for e in it)
    except OSError:
        tops = []
    left = tuple(t for t in tops if t not in packed_top and not _empty_dir(Path(directory) / t))
    largest = tuple(sorted(sizes, key=lambda x: -x[1])[:shown])
    return Packed(len(sizes), sum(n for _, n in sizes), largest, left)


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def bundle_id(data: bytes) -> str:
    """The bundle's id: the sha256 of its bytes, lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def pack(directory: Path) -> bytes:
    """`directory`'s files as a reproducible gzip-compressed tar (see the module docstring);
    `.git`, `__pycache__`, `.venv`, `*.pyc` and what `.torchyardignore` lists are left out."""
    root = Path(directory)
    if not root.is_dir():
        raise PackError(f"{str(directory)!r}: no such directory")
    entries = sorted(_walk(root, _ignore_spec(root)), key=lambda e: e.name)
    for entry in entries:
        if "/" not in entry.name and entry.name in _RESERVED:
            raise PackError(f"{entry.name!r}: a reserved top-level name (torchyard's own)")
    if not any(e.kind == "file" for e in entries):
        raise PackError(f"{str(directory)!r}: no files to pack")
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for entry in entries:
            _add(tar, entry)
    return buf.getvalue()


def _ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    ignore = root / IGNORE_FILE
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _skipped(name: str, rel: str, is_dir: bool, spec: pathspec.GitIgnoreSpec) -> bool:
    if name in _ALWAYS_SKIPPED or (not is_dir and name.endswith(_SKIPPED_SUFFIXES)):
        return True
    # A trailing slash lets directory-only patterns (`data/`) match the directory itself.
    return spec.match_file(f"{rel}/" if is_dir else rel)


def _walk(root: Path, spec: pathspec.GitIgnoreSpec) -> list[_Entry]:
    """Every entry to pack; an ignored directory is not entered (as git does)."""
    found: list[_Entry] = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(root / rel_dir) as it:
            for item in it:
                rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
                is_dir = item.is_dir(follow_symlinks=False)
                if _skipped(item.name, rel, is_dir, spec):
                    continue
                if item.is_symlink():
                    found.append(_symlink(root, rel, Path(item.path)))
                elif is_dir:
                    found.append(_Entry(rel, Path(item.path), "dir", 0o755))
                    stack.append(rel)
                elif item.is_file(follow_symlinks=False):
                    executable = item.stat(follow_symlinks=False).st_mode & 0o111
                    found.append(
                        _Entry(rel, Path(item.path), "file", 0o755 if executable else 0o644)
                    )
                else:
                    raise PackError(f"{rel!r}: not a regular file, directory or symlink")
    return found


def _symlink(root: Path, rel: str, path: Path) -> _Entry:
    """A symlink kept as one, refused when its target lies outside `root`: absolute, up
    through `..`, or through other symlinks (resolved on disk)."""
    target = os.readlink(path)
    lexical = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    real_root = root.resolve()
    resolved = Path(os.path.realpath(path))
    inside = resolved == real_root or real_root in resolved.parents
    if os.path.isabs(target) or lexical == ".." or lexical.startswith("../") or not inside:
        raise PackError(f"{rel!r}: a symlink to {target!r}, outside {str(root)!r}")
    return _Entry(rel, path, "symlink", 0o644, target)


def _add(tar: tarfile.TarFile, entry: _Entry) -> None:
    info = tarfile.TarInfo(entry.name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.target
        tar.addfile(info)
    else:
        with entry.path.open("rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise PackError(f"{entry.name!r}: no longer a regular file")
            info.size = st.st_size
            tar.addfile(info, f)
