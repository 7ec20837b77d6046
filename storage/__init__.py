"""torchyard.storage: the one seam through which the services read and write stored files
(a job's checkpoints, weights, log and events; code bundles; init weights), by key
(storage/keys.py) through the `Storage` interface (storage/base.py).

Which backend: the storage URL's scheme, looked up in `BACKENDS` ("module:Class", imported
when first chosen, so a backend's client library loads only where it is used). Today the
URL is TORCHYARD_STORAGE_URL: `file://…` (storage/local.py, the default: the storage
root), `s3://bucket/prefix` (storage/s3.py, any S3-compatible store) or `memory://` (the
in-memory backend tests use).

A job's run directory, the local folder its trainer writes into (`--run-dir`), is decided
here too: `run_dir(settings, job_id)`, the backend's `run_dir`.
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from torchyard.settings import Settings
from torchyard.storage.base import ObjectInfo, Storage, Tail
from torchyard.storage.keys import UnsafePath, check_key, job_key, job_prefix

__all__ = [
    "BACKENDS",
    "ObjectInfo",
    "Storage",
    "Tail",
    "UnsafePath",
    "backend_class",
    "check_key",
    "check_storage",
    "job_key",
    "job_prefix",
    "open_storage",
    "run_dir",
    "storage_for",
    "storage_url",
]

BACKENDS: dict[str, str] = {
    "file": "torchyard.storage.local:LocalStorage",
    "memory": "torchyard.storage.memory:MemoryStorage",
    "s3": "torchyard.storage.s3:S3Storage",
}

_CACHE_SIZE = 32  # settings objects seen by one process (tests make one per test)
_cache: dict[tuple[str, str], Storage] = {}
_cache_lock = threading.Lock()


def backend_class(scheme: str) -> type[Storage]:
    """The backend registered for `scheme`; ValueError naming the known ones if none."""
    target = BACKENDS.get(scheme)
    if target is None:
        known = ", ".join(f"{s}://" for s in sorted(BACKENDS))
        raise ValueError(f"no storage backend for {scheme}:// (known: {known})")
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise TypeError(f"{target} is not a Storage backend")
    return cls


def storage_url(settings: Settings) -> str:
    """Where stored files live, as a URL: TORCHYARD_STORAGE_URL, else the storage root
    (TORCHYARD_STORAGE_ROOT) as `file://`."""
    return settings.storage_url or settings.storage.as_uri()


def open_storage(url: str, settings: Settings) -> Storage:
    """A new backend for `url` (its scheme chooses the class, which reads the rest)."""
    cls = backend_class(urlparse(url).scheme)
    return cls.from_url(url, settings)


def storage_for(settings: Settings) -> Storage:
    """The storage `settings` name, one instance per storage URL and home in a process."""
    key = (storage_url(settings), str(settings.home))
    with _cache_lock:
        found = _cache.pop(key, None)
        if found is not None:
            _cache[key] = found  # most recently used last
            return found
    made = open_storage(key[0], settings)
    with _cache_lock:
        made = _cache.setdefault(key, made)
        while len(_cache) > _CACHE_SIZE:
            del _cache[next(iter(_cache))]
    return made


def run_dir(settings: Settings, job_id: str) -> Path:
    """The job's run directory on this host: what the worker passes the trainer as
    `--run-dir` (and `torchyard.job` writes into), the one place it is decided."""
    return storage_for(settings).run_dir(job_id)


def check_storage(settings: Settings) -> bool:
    """At a service's start: the storage answers as configured (an object store's bucket,
    credentials and endpoint); False after printing what to fix, naming the setting, so a
    bad one fails the start rather than the first checkpoint."""
    from torchyard.storage.base import StorageConfigError

    try:
        storage_for(settings).check()
    except (StorageConfigError, ValueError) as e:
        print(f"torchyard: bad setting: {e}", file=sys.stderr)
        return False
    return True
