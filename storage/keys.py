"""Storage keys: how a stored object is named relative to the storage root, and the one
check every key passes before any backend touches it.

A key is a relative POSIX path (`jobs/<job_id>/checkpoints/step-00000010.pt`,
`bundles/<sha256>.tar.gz`, `datasets/mnist.json`, `datasets/blobs/<sha256>`), never a
user's path: absolute names, `..` parts and NUL are
refused with `UnsafePath`, and `.` or empty parts are dropped, so one object has one key.
A key's *scope* is the folder it must not leave once a backend resolves it (symlinks on the
local file system): a job's folder for a job's files, the top folder otherwise.
"""

from __future__ import annotations

import re

__all__ = [
    "BUNDLES",
    "DATASETS",
    "JOBS",
    "UnsafePath",
    "bundle_key",
    "check_key",
    "dataset_blob_key",
    "dataset_manifest_key",
    "is_bundle_id",
    "job_key",
    "job_prefix",
    "scope_of",
    "stored_file_key",
]

JOBS = "jobs"  # jobs/<job_id>/…: a job's run directory, all attempts
BUNDLES = "bundles"  # bundles/<sha256>.tar.gz and its names file
DATASETS = "datasets"  # datasets/<name>.json (a manifest), datasets/blobs/<sha256> (a file)

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_BUNDLE_ID = re.compile(r"^[0-9a-f]{64}$")


class UnsafePath(ValueError):
    """A key (or stored path) that would leave its folder: absolute, with a `..` part or a
    NUL, or resolving elsewhere through a symlink."""


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """`key` in its one canonical form (no `.` or empty parts), or UnsafePath.
    `allow_empty`: the root itself (a listing of everything)."""
    if not isinstance(key, str) or "\x00" in key or key.startswith("/"):
        raise UnsafePath(f"refused path {key!r}")
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(f"refused path {key!r}: outside its folder (a '..' part)")
    if not parts and not allow_empty:
        raise UnsafePath(f"refused path {key!r}")
    return "/".join(parts)


def scope_of(key: str) -> str:
    """The folder a (checked) key may not resolve out of: `jobs/<id>` for a job's files,
    else the key's first part."""
    parts = key.split("/")
    if parts[0] == JOBS and len(parts) > 1:
        return f"{JOBS}/{parts[1]}"
    return parts[0]


def job_prefix(job_id: str) -> str:
    """`jobs/<job_id>`: the folder of a job's files (its run directory's contents)."""
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise UnsafePath(f"not a job id: {job_id!r}")
    return f"{JOBS}/{job_id}"


def job_key(job_id: str, relative: str) -> str:
    """The key of a file of a job, `relative` to its run directory (as the trainer's
    events name it); UnsafePath when `relative` would leave it."""
    return f"{job_prefix(job_id)}/{check_key(relative)}"


def stored_file_key(job_id: str, relative: str, sha256: str) -> str:
    """The key of a checkpoint or weights file an object store holds: its run-directory
    key with its sha256 appended (`…/step-00000040.pt.sha256-<hex>`). The name says which
    bytes it holds, so a fenced attempt still uploading (its worker cut off from the
    database, not from the store) can never overwrite the file a later attempt recorded
    under the same path; identical bytes land on one key. UnsafePath for a sha256 that is
    not 64 lowercase hex digits."""
    if not is_bundle_id(sha256):
        raise UnsafePath(f"not a sha256 (64 lowercase hex digits): {sha256!r}")
    return f"{job_key(job_id, relative)}.sha256-{sha256}"


def is_bundle_id(value: object) -> bool:
    """A sha256 in lowercase hex: what a bundle id is."""
    return isinstance(value, str) and _BUNDLE_ID.fullmatch(value) is not None


def bundle_key(bundle_id: str, suffix: str = ".tar.gz") -> str:
    """`bundles/<id><suffix>`: a code bundle's archive (`.tar.gz`) or its names file."""
    if not is_bundle_id(bundle_id):
        raise UnsafePath(f"not a bundle id (64 lowercase hex digits): {bundle_id!r}")
    return f"{BUNDLES}/{bundle_id}{suffix}"


def dataset_manifest_key(name: str) -> str:
    """`datasets/<name>.json`: a stored data set's manifest (`mnist`, `imagefolder/<dir>`:
    the `/` of an imagefolder name is a folder of the store). The name must already be one
    the spec allows (storage/datasets.py checks it); this refuses only an unsafe key."""
    clean = check_key(name)
    if clean != name or clean.split("/")[0] == "blobs":
        raise UnsafePath(f"not a data set name: {name!r}")
    return f"{DATASETS}/{clean}.json"


def dataset_blob_key(sha256: str) -> str:
    """`datasets/blobs/<sha256>`: one data-set file, named by the sha256 of its bytes."""
    if not is_bundle_id(sha256):
        raise UnsafePath(f"not a sha256 (64 lowercase hex digits): {sha256!r}")
    return f"{DATASETS}/blobs/{sha256}"
