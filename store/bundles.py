"""Code bundles as the store sees them: one row per (archive, owner), and the list of file
names kept beside each archive.

The archive itself is `<storage>/bundles/<id>.tar.gz` (store/bundlefiles.py), its id the
sha256 of the uploaded bytes: two users uploading the same bytes share the file but each
owns a row, and a user may name in a job only a bundle they own. The names of its files
are written once, at upload, to `<id>.files.json` beside it, so the API can check that a
spec's entrypoint script is in the bundle without opening the archive.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from torchyard.store.bundlefiles import archive_path, is_bundle_id
from torchyard.store.models import Bundle, utcnow


def get_bundle(session: Session, owner_id: int | None, bundle_id: str) -> Bundle | None:
    """The owner's row of the bundle, or None (also for a malformed id). `owner_id=None`:
    any owner's row (what an admin may see); the rows of one id differ only in owner."""
    if not is_bundle_id(bundle_id):
        return None
    if owner_id is not None:
        return session.get(Bundle, (bundle_id, owner_id))
    return session.scalar(select(Bundle).where(Bundle.id == bundle_id).limit(1))


def record_bundle(session: Session, owner_id: int, bundle_id: str, bytes: int, files: int) -> bool:
    """Record that `owner_id` uploaded the bundle; True when the row is new. Idempotent,
    also under a race: two uploads of the same bytes at once both end with one row (the
    loser's insert fails on the primary key, in a savepoint, and it answers False)."""
    if get_bundle(session, owner_id, bundle_id) is not None:
        return False
    try:
        with session.begin_nested():
            session.add(
                Bundle(
                    id=bundle_id, owner_id=owner_id, bytes=bytes, files=files, created_at=utcnow()
                )
            )
            session.flush()
    except IntegrityError:
        return False
    return True


def names_path(storage: Path, bundle_id: str) -> Path:
    """`<storage>/bundles/<id>.files.json`: the archive's file names."""
    return archive_path(storage, bundle_id).with_name(f"{bundle_id}.files.json")


def write_bundle_names(storage: Path, bundle_id: str, names: list[str]) -> None:
    """Write the names file atomically (tmp + fsync + rename): a reader sees all of it or
    none, and an upload that dies half way leaves no half-written list behind."""
    target = names_path(storage, bundle_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{bundle_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(sorted(names), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def bundle_names(storage: Path, bundle_id: str) -> list[str] | None:
    """The names of the bundle's files, or None when they are not on record (an unknown
    or malformed id, or a names file that is missing or unreadable)."""
    if not is_bundle_id(bundle_id):
        return None
    try:
        names = json.loads(names_path(storage, bundle_id).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names
