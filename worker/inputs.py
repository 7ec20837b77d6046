"""What a job brings besides its spec, made ready on this host before its trainer starts:
its code bundle (unpacked once per bundle and host, content-checked: store/bundlefiles.py),
the file of weights its `init` names (checked against its recorded sha256) and, with an
object store, its data set (pulled into this host's data root and checked:
storage/datasets.py). All are read from storage through the seam (torchyard.storage):
their own files on a local backend, a copy fetched to this host otherwise.

A problem here is the job's, and running it again would meet it again: `InputError`
fails the attempt without a retry. A full disk or a store out of reach is not the job's
(an OSError: a full disk hands the attempt back, another failure is counted and retried).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from torchyard.settings import Settings
from torchyard.storage import beneath, storage_for
from torchyard.storage.base import ChecksumMismatch
from torchyard.storage.datasets import DatasetRejected, needs_files, sync_dataset
from torchyard.storage.keys import UnsafePath
from torchyard.storage.local import LocalStorage
from torchyard.store.bundlefiles import BundleRejected, archive_key, unpack_stored
from torchyard.store.checkpoints import checkpoint_key, init_checkpoint
from torchyard.store.models import Checkpoint


class InputError(Exception):
    """The job's bundle, init weights or data set cannot be had: fail it, do not retry."""


def bundle_cache(settings: Settings) -> Path:
    """Unpacked bundles on this host: under TORCHYARD_HOME, shared by its workers."""
    return settings.home.resolve() / "cache" / "bundles"


def code_dir(settings: Settings, spec: dict[str, Any]) -> Path | None:
    """The job's unpacked bundle (None: the job has no code)."""
    bundle = (spec.get("code") or {}).get("bundle")
    if not bundle:
        return None
    storage = storage_for(settings)
    key = archive_key(bundle)
    if not storage.exists(key):
        where = storage.describe(key)
        raise InputError(f"code bundle {bundle}: its archive {where} is missing from storage")
    try:
        return unpack_stored(
            storage,
            bundle,
            bundle_cache(settings),
            max_files=settings.max_bundle_files,
            max_bytes=settings.max_bundle_bytes,
        )
    except BundleRejected as e:
        raise InputError(f"code bundle {bundle}: {e.reason}") from None


def init_source(session: Session, spec: dict[str, Any]) -> Checkpoint | None:
    """The recorded checkpoint the spec's `init` names (None: no init). Only this reads
    the store: the file is checked after the session is closed (`init_file`)."""
    init = spec.get("init")
    if not init:
        return None
    source, which = init["from_job"], init.get("checkpoint", "latest")
    row = init_checkpoint(session, source, which)
    if row is None:
        raise InputError(f"init: job {source} has no checkpoint '{which}' on record")
    return row


def init_file(settings: Settings, row: Checkpoint) -> Path:
    """A local file of an init checkpoint (what the trainer gets as `--init`), its
    recorded sha256 checked (a read of the whole file: never inside a store transaction).
    On a local storage the file lies in the source job's run directory, where that job can
    swap it for a link at any instant: the worker copies it by descriptor into its own
    cache and checks the copy, and the trainer gets the copy."""
    try:
        storage = storage_for(settings)
        key = checkpoint_key(storage, row)
        if not isinstance(storage, LocalStorage):  # fetched into this host's cache, checked
            return storage.local_copy(key, sha256=row.sha256 or None)
        return _private_copy(init_cache(settings), storage.root, key, row.sha256 or None)
    except ChecksumMismatch:
        raise InputError(
            f"init: job {row.job_id}'s {row.path} does not match its recorded sha256"
        ) from None
    except (FileNotFoundError, UnsafePath):
        raise InputError(
            f"init: the file of job {row.job_id}'s checkpoint {row.path} is gone"
        ) from None


def init_cache(settings: Settings) -> Path:
    """Init weights copied out of run directories: under TORCHYARD_HOME, the worker's own."""
    return settings.home.resolve() / "cache" / "init"


INIT_CACHE_KEEP_S = 24 * 3600  # a copy not used for a day is removed when another is made


def _private_copy(cache: Path, root: Path, key: str, sha256: str | None) -> Path:
    """`root/key` copied into `cache/<sha256><its suffix>` (content-addressed: reused while
    it is there; the suffix tells the trainer a safetensors file from a checkpoint), hashed
    as it is copied and checked against `sha256`."""
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    suffix = "".join(c for c in Path(key).suffix if c.isalnum() or c == ".")[:16]
    if sha256 is not None:
        known = cache / f"{sha256}{suffix}"
        with contextlib.suppress(FileNotFoundError):
            os.utime(known)  # in use: not evicted
            return known
    tmp = cache / f".{secrets.token_hex(8)}.tmp"
    try:
        got, _ = beneath.copy_out(root, key, tmp)
        if sha256 is not None and got != sha256:
            raise ChecksumMismatch(f"sha256 {got}, recorded {sha256}")
        os.replace(tmp, cache / f"{got}{suffix}")
    finally:
        tmp.unlink(missing_ok=True)
    _evict(cache, keep=f"{got}{suffix}")
    return cache / f"{got}{suffix}"


def _evict(cache: Path, keep: str) -> None:
    cutoff = time.time() - INIT_CACHE_KEEP_S
    with os.scandir(cache) as entries:
        for e in entries:
            if e.name != keep and e.stat(follow_symlinks=False).st_mtime < cutoff:
                with contextlib.suppress(OSError):
                    os.unlink(e.path)


def data_ready(settings: Settings, spec: dict[str, Any]) -> Path | None:
    """With an object store: the job's data set (one of files: `mnist`, `imagefolder/<dir>`,
    …) made to match the store's copy in this host's data root (TORCHYARD_DATA_ROOT), where
    the trainer reads it; its folder. None when there is nothing to pull: a local storage
    (the data root is the admin's), a set of no files, or one the store does not hold (the
    data root is used as it is). A bad manifest, a missing blob or one that does not match
    its sha256 is an InputError; the store out of reach, an OSError."""
    data = spec.get("data")
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not needs_files(name) or spec.get("entrypoint"):
        return None
    storage = storage_for(settings)
    if storage.stored_run_dirs:
        return None
    try:
        return sync_dataset(storage, name, settings.data)
    except DatasetRejected as e:
        raise InputError(str(e)) from None
