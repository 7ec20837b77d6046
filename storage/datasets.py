"""Data sets in the store, so that every worker host trains on one without copying files
by hand: published once (`publish_dataset`: `torchyard data import` with an object store,
`torchyard data upload`), pulled into a host's data root before a job reads it
(`sync_dataset`, the worker's `worker/inputs.py: data_ready`).

In the store a data set is its manifest, `datasets/<name>.json` (`mnist`, `cifar10`,
`imagefolder/<dir>`, …: storage/keys.py), holding `name`, `folder` (its folder in a data
root: `MNIST`, `cifar-10-batches-py`, `<dir>`), `files` (each `path` relative to the
folder, `size`, `sha256`) and `created`; and one content-addressed object per distinct
file, `datasets/blobs/<sha256>`, uploaded once (a blob the store already has with that
sha256 is skipped). The blobs go up first and the manifest last, written whole: a reader
never sees a manifest whose blobs are missing.

On a host, `data_root/<folder>` is made to match the manifest: a marker file in it,
`.torchyard-dataset.json`, records the sha256 of the manifest it was made from, so a host
that has it costs one HEAD of the manifest. Otherwise the files are put together in a
staging folder beside the target (a file of the host's older copy that hashes to the
manifest's sha256 is linked over; every other blob fetched and checked against its sha256:
a mismatch or a missing blob is `DatasetRejected` and nothing is installed), made readable
by all (trainers run as the sandbox's own user) and renamed into place; the older version
is moved aside, then removed.
Workers of one host sync under one lock file per data set (`data_root/.<folder>.lock`,
an flock the kernel drops if its holder dies). A name the store has no manifest for is
left to the data root as before (`None`). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torchyard.contracts.datasets import DATASET_FILES
from torchyard.contracts.spec import IMAGEFOLDER_RE
from torchyard.storage.base import COPY_BLOCK, Storage
from torchyard.storage.keys import (
    DATASETS,
    dataset_blob_key,
    dataset_manifest_key,
    is_bundle_id,
)

__all__ = [
    "MARKER",
    "MAX_FILES",
    "MAX_TOTAL_BYTES",
    "DatasetRejected",
    "Entry",
    "Manifest",
    "Published",
    "dataset_folder",
    "needs_files",
    "publish_dataset",
    "read_manifest",
    "readable_by_all",
    "scan_tree",
    "stored_datasets",
    "sync_dataset",
    "synced_sha256",
]

MARKER = ".torchyard-dataset.json"  # in data_root/<folder>: the manifest it was made from
# Bounds on one data set (ImageNet's training set is ~1.28 M files, ~140 GB: a set that
# big is better mounted than copied to each host).
MAX_FILES = 1_000_000
MAX_TOTAL_BYTES = 512 * 1024**3
MAX_MANIFEST_BYTES = 256 * 1024**2
CONCURRENCY = 8  # blobs hashed, uploaded or fetched at once
# The built-in sets' folders: no `imagefolder/<dir>` may be published into one of them.
BUILTIN_FOLDERS = frozenset(files[0].split("/")[0] for files in DATASET_FILES.values())


class DatasetRejected(Exception):
    """The data set cannot be published or installed as it is (a link or special file in
    the folder, a bad manifest, a blob missing from the store or not matching its sha256):
    the same next time, so not an OSError (an OSError is the host's or the store's)."""


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the data set's folder, POSIX
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    name: str
    folder: str
    files: tuple[Entry, ...]
    created: str

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files)

    def same_content(self, other: Manifest) -> bool:
        return (self.name, self.folder, self.files) == (other.name, other.folder, other.files)

    def to_bytes(self) -> bytes:
        files = [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.files]
        body = {"name": self.name, "folder": self.folder, "files": files, "created": self.created}
        return json.dumps(body, indent=None, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    key: str  # the manifest's key
    uploaded: int  # blobs sent
    present: int  # blobs the store already had
    unchanged: bool  # the store held this very content already: its manifest was kept


# ---------------------------------------------------------------------------- names


def needs_files(name: str) -> bool:
    """Whether the data set `name` is files in a data root (`mnist`, `imagefolder/<dir>`…),
    not generated or bundled (`digits`, `synthetic`) or the user's own (`module:function`)."""
    return name in DATASET_FILES or IMAGEFOLDER_RE.fullmatch(name) is not None


def dataset_folder(name: str) -> str:
    """The folder of `name` in a data root (torchvision's: `MNIST`, `FashionMNIST`,
    `cifar-10-batches-py`; `<dir>` for `imagefolder/<dir>`); DatasetRejected for a name
    that has no files."""
    if name in DATASET_FILES:
        return DATASET_FILES[name][0].split("/")[0]
    if IMAGEFOLDER_RE.fullmatch(name):
        return name.partition("/")[2]
    raise DatasetRejected(
        f"'{name}' is not a data set of files (one of {', '.join(DATASET_FILES)} or "
        "imagefolder/<dir>)"
    )


def _check_path(path: Any) -> str:
    """A manifest's file path: relative, POSIX, no `.`/`..`/empty parts, not the marker."""
    if not isinstance(path, str) or not path or "\x00" in path or path.startswith("/"):
        raise DatasetRejected(f"refused file path {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or path == MARKER:
        raise DatasetRejected(f"refused file path {path!r}")
    return path


def _check_bounds(count: int, total: int, what: str) -> None:
    if count > MAX_FILES:
        raise DatasetRejected(f"{what}: more than {MAX_FILES} files")
    if total > MAX_TOTAL_BYTES:
        raise DatasetRejected(f"{what}: more than {MAX_TOTAL_BYTES} bytes")


# ---------------------------------------------------------------------------- publishing


def scan_tree(tree: Path) -> list[tuple[str, Path, int]]:
    """Every file under `tree` as (relative path, path, size), sorted; DatasetRejected for
    a symbolic link, a special file (FIFO, socket, device), too many files or bytes, or
    no file at all. The marker of a synced copy (top level) is left out."""
    if tree.is_symlink() or not tree.is_dir():
        raise DatasetRejected(f"{tree}: not a folder")
    found: list[tuple[str, Path, int]] = []
    total = 0
    pending = [(tree, "")]
    while pending:
        folder, rel = pending.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            sub = f"{rel}{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise DatasetRejected(f"{e.path}: a symbolic link (copy the file itself in)")
            if stat.S_ISDIR(st.st_mode):
                pending.append((Path(e.path), sub + "/"))
            elif not stat.S_ISREG(st.st_mode):
                raise DatasetRejected(f"{e.path}: not a regular file")
            elif sub != MARKER:
                found.append((_check_path(sub), Path(e.path), st.st_size))
                total += st.st_size
                _check_bounds(len(found), total, str(tree))
    if not found:
        raise DatasetRejected(f"{tree}: no files")
    return sorted(found)


def _hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(COPY_BLOCK):
            h.update(block)
    return h.hexdigest()


def _all_at_once(jobs: Iterable[Callable[[], Any]]) -> list[Any]:
    """Run `jobs` on CONCURRENCY threads; their results in order. The first failure is
    raised once the jobs under way have ended (the rest are not started)."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures: list[Future[Any]] = [pool.submit(job) for job in jobs]
        try:
            for f in as_completed(futures):
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return [f.result() for f in futures]


def _upload_blob(storage: Storage, path: Path, sha: str) -> bool:
    """Put one file as its blob unless the store has it (with that sha256); True if sent."""
    key = dataset_blob_key(sha)
    try:
        if storage.stat(key).sha256 == sha:
            return False
    except FileNotFoundError:
        pass
    storage.write_file(key, path, sha256=sha)  # ChecksumMismatch if it changed meanwhile
    return True


def publish_dataset(storage: Storage, name: str, tree: Path, *, force: bool = False) -> Published:
    """Store the folder `tree` as the data set `name` (its content becomes `data_root/
    <folder>` on each host that syncs it): blobs first (each once), the manifest last.
    A different data set already stored under `name` is kept unless `force`."""
    folder = dataset_folder(name)
    if name not in DATASET_FILES and folder in BUILTIN_FOLDERS:
        raise DatasetRejected(f"'{name}' would share its folder with a built-in data set")
    files = scan_tree(tree)
    hashes = _all_at_once([partial(_hash, p) for _, p, _ in files])
    entries = tuple(
        Entry(rel, size, sha) for (rel, _, size), sha in zip(files, hashes, strict=True)
    )
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest = Manifest(name, folder, entries, created)
    old = read_manifest(storage, name)
    if old is not None and not old[0].same_content(manifest) and not force:
        raise DatasetRejected(
            f"the store already holds a different '{name}' "
            f"({len(old[0].files)} files): --force replaces it"
        )
    by_sha = {sha: path for (_, path, _), sha in zip(files, hashes, strict=True)}
    sent = _all_at_once([partial(_upload_blob, storage, p, s) for s, p in by_sha.items()])
    uploaded = sum(1 for s in sent if s)
    key = dataset_manifest_key(name)
    if old is not None and old[0].same_content(manifest):
        return Published(old[0], key, uploaded, len(by_sha) - uploaded, True)
    storage.write_bytes(key, manifest.to_bytes())  # last: its blobs are all there
    return Published(manifest, key, uploaded, len(by_sha) - uploaded, False)


# ---------------------------------------------------------------------------- reading


def _parse_entry(item: Any) -> Entry:
    if not isinstance(item, dict):
        raise DatasetRejected("a file entry is not an object")
    size, sha = item.get("size"), item.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DatasetRejected(f"bad size {size!r}")
    if not isinstance(sha, str) or not is_bundle_id(sha):
        raise DatasetRejected(f"bad sha256 {sha!r}")
    return Entry(_check_path(item.get("path")), size, sha)


def parse_manifest(raw: bytes, name: str) -> Manifest:
    """A stored manifest, every field checked (a store is not trusted with the host's
    paths): DatasetRejected naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetRejected(f"data set '{name}': its manifest is not JSON ({e})") from None
    try:
        if not isinstance(body, dict):
            raise DatasetRejected("it is not an object")
        if body.get("name") != name:
            raise DatasetRejected(f"it names {body.get('name')!r}")
        if body.get("folder") != dataset_folder(name):
            raise DatasetRejected(f"its folder {body.get('folder')!r} is not {name}'s")
        items = body.get("files")
        if not isinstance(items, list) or not items:
            raise DatasetRejected("it lists no files")
        entries = tuple(_parse_entry(i) for i in items)
        _check_bounds(len(entries), sum(e.size for e in entries), "it")
        paths = {e.path for e in entries}
        parents = {p.rsplit("/", 1)[0] + "/" for p in paths if "/" in p}
        if len(paths) != len(entries) or any(p + "/" in parents for p in paths):
            raise DatasetRejected("it lists a path twice, or as a file and a folder")
    except DatasetRejected as e:
        raise DatasetRejected(f"data set '{name}': bad manifest: {e}") from None
    return Manifest(name, body["folder"], entries, str(body.get("created", "")))


def read_manifest(storage: Storage, name: str) -> tuple[Manifest, str] | None:
    """The stored manifest of `name` and the sha256 of its bytes; None when there is none."""
    key = dataset_manifest_key(name)
    try:
        raw, size = storage.read_range(key, 0, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None
    if size > MAX_MANIFEST_BYTES:
        raise DatasetRejected(f"data set '{name}': its manifest is over {MAX_MANIFEST_BYTES} bytes")
    return parse_manifest(raw, name), hashlib.sha256(raw).hexdigest()


def stored_datasets(storage: Storage) -> list[Manifest]:
    """Every data set the store has (the built-in names looked up, imagefolder ones listed),
    by name. A manifest that does not parse is left out."""
    names = [n for n in DATASET_FILES if storage.exists(dataset_manifest_key(n))]
    top = f"{DATASETS}/imagefolder/"
    for info in storage.list(f"{DATASETS}/imagefolder"):
        rel = info.key[len(top) :]
        if rel.endswith(".json") and IMAGEFOLDER_RE.fullmatch(f"imagefolder/{rel[:-5]}"):
            names.append(f"imagefolder/{rel[:-5]}")
    found = []
    for n in names:
        with contextlib.suppress(DatasetRejected):
            if (got := read_manifest(storage, n)) is not None:
                found.append(got[0])
    return found


# ---------------------------------------------------------------------------- on a host


def synced_sha256(target: Path) -> str | None:
    """The sha256 of the manifest `target` (a data set's folder) was made from, per its
    marker; None when it has none (or is a link, or not ours)."""
    marker = target / MARKER
    try:
        if target.is_symlink() or not target.is_dir() or marker.is_symlink():
            return None
        saved = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    sha = saved.get("manifest_sha256") if isinstance(saved, dict) else None
    return sha if isinstance(sha, str) else None


def readable_by_all(folder: Path) -> None:
    """Data sets are shared by every job, and trainers run as the sandbox's own user
    (worker/sandbox.py): whatever the service's umask, they may read, never write."""
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, between processes and threads alike (each open() is
    its own open file description); the kernel drops it if its holder dies."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _sweep(data_root: Path, folder: str) -> None:
    """A crash's staging and moved-aside folders of `folder` (under its lock: nobody else
    is syncing it here)."""
    for stale in (*data_root.glob(f".{folder}.sync-*"), *data_root.glob(f".{folder}.old-*")):
        _remove(stale)


def _fetch_blob(storage: Storage, name: str, entry: Entry, dest: Path) -> None:
    """The blob of `entry` into the new file `dest`, checked against its size and sha256."""
    key = dataset_blob_key(entry.sha256)
    try:
        src = storage.open_read(key)
    except FileNotFoundError:
        raise DatasetRejected(
            f"data set '{name}': {entry.path} ({storage.describe(key)}) is missing from the store"
        ) from None
    h, n = hashlib.sha256(), 0
    with src, open(dest, "xb") as out:
        while n <= entry.size and (block := src.read(COPY_BLOCK)):
            h.update(block)
            n += len(block)
            out.write(block)
    if n != entry.size or h.hexdigest() != entry.sha256:
        raise DatasetRejected(
            f"data set '{name}': {entry.path} from {storage.describe(key)} does not match its "
            f"sha256 ({entry.sha256}, {entry.size} bytes): refused"
        )


def _from_old(old: Path, entry: Entry, dest: Path) -> bool:
    """`entry` taken from the copy this host has (`old/<path>`, a regular file that hashes
    to its sha256: linked, or copied), so a new version fetches only what changed."""
    src = old / entry.path
    try:
        st = os.lstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size or _hash(src) != entry.sha256:
            return False
        try:
            os.link(src, dest, follow_symlinks=False)
        except OSError:
            shutil.copyfile(src, dest, follow_symlinks=False)
    except OSError:
        return False
    return True


def _fetch_all(storage: Storage, manifest: Manifest, tree: Path, old: Path) -> None:
    """Every file of `manifest` under `tree`: each distinct blob taken from the host's
    older copy `old` where it has it unchanged, else fetched once (in parallel); copies of
    it made locally."""
    for parent in sorted({str(Path(e.path).parent) for e in manifest.files}):
        (tree / parent).mkdir(parents=True, exist_ok=True)
    first: dict[str, Entry] = {}
    for e in manifest.files:
        first.setdefault(e.sha256, e)

    def one(e: Entry) -> None:
        if not _from_old(old, e, tree / e.path):
            _fetch_blob(storage, manifest.name, e, tree / e.path)

    _all_at_once([partial(one, e) for e in first.values()])
    for e in manifest.files:
        if first[e.sha256] is not e:
            shutil.copyfile(tree / first[e.sha256].path, tree / e.path)


def _install(storage: Storage, manifest: Manifest, sha: str, data_root: Path) -> Path:
    """Fetch `manifest` into a staging folder beside its target, then swap it in."""
    target = data_root / manifest.folder
    stage = Path(tempfile.mkdtemp(prefix=f".{manifest.folder}.sync-", dir=data_root))
    try:
        tree = stage / manifest.folder
        tree.mkdir()
        _fetch_all(storage, manifest, tree, target)
        marker = {
            "name": manifest.name,
            "manifest_sha256": sha,
            "files": len(manifest.files),
            "bytes": manifest.total_bytes,
            "synced": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tree / MARKER).write_text(json.dumps(marker))
        readable_by_all(tree)
        old = None
        if os.path.lexists(target):
            old = data_root / f".{manifest.folder}.old-{secrets.token_hex(4)}"
            os.rename(target, old)
        os.rename(tree, target)
        if old is not None:
            _remove(old)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


def sync_dataset(storage: Storage, name: str, data_root: Path) -> Path | None:
    """Make `data_root/<folder>` the data set `name` as the store has it; its path, or
    None when the store has no manifest for it (the data root is then used as it is).
    DatasetRejected for a bad manifest, a missing blob or one that does not match its
    sha256 (nothing installed); an OSError when the store or the disk fails."""
    folder = dataset_folder(name)
    target = data_root / folder
    try:
        info = storage.stat(dataset_manifest_key(name))
    except FileNotFoundError:
        return None
    have = synced_sha256(target)
    if have is not None and have == info.sha256:
        return target  # the fast path: one HEAD
    got = read_manifest(storage, name)
    if got is None:
        return None
    manifest, sha = got
    if have == sha:
        return target
    if not data_root.is_dir():
        data_root.mkdir(parents=True, exist_ok=True)
        os.chmod(data_root, 0o755)  # passable by the sandbox's user whatever the umask
    with _locked(data_root / f".{folder}.lock"):
        if synced_sha256(target) == sha:  # another worker of this host just did it
            return target
        _sweep(data_root, folder)
        return _install(storage, manifest, sha, data_root)
