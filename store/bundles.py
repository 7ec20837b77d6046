"""Code bundles as the store sees them: one row per (archive, owner), and the list of file
names kept beside each archive.

The archive itself is the stored object `bundles/<id>.tar.gz` (store/bundlefiles.py), its
id the sha256 of the uploaded bytes: two users uploading the same bytes share the file but
each owns a row, and a user may name in a job only a bundle they own. The names of its
files are written at upload to `bundles/<id>.files.json` beside it (through the storage
seam), so the API can check that a spec's entrypoint script is in the bundle without
opening the archive.
"""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from torchyard.storage import Storage
from torchyard.store.bundlefiles import is_bundle_id, names_key
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


def write_bundle_names(storage: Storage, bundle_id: str, names: list[str]) -> None:
    """Write the names file atomically (the storage's write: a reader sees all of it or
    none, and an upload that dies half way leaves no half-written list behind)."""
    storage.write_bytes(names_key(bundle_id), json.dumps(sorted(names)).encode())


def bundle_names(storage: Storage, bundle_id: str) -> list[str] | None:
    """The names of the bundle's files, or None when they are not on record (an unknown
    or malformed id, or a names file that is missing or unreadable)."""
    if not is_bundle_id(bundle_id):
        return None
    try:
        with storage.open_read(names_key(bundle_id)) as f:
            names = json.loads(f.read())
    except (OSError, ValueError):  # missing, refused (UnsafePath) or not JSON
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names
