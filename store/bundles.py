"""Code bundles as the store sees them: one row per (archive, owner), and the list of file
names kept beside each archive.

The archive itself is the stored object `bundles/<id>.tar.gz` (store/bundlefiles.py), its
id the sha256 of the uploaded bytes: two users uploading the same bytes share the file but
each owns a row, and a user may name in a job only a bundle they own. The names of its
files are written at upload to `bundles/<id>.files.json` beside it (through the storage
seam), so the API can check that a spec's entrypoint script is in the bundle without
opening the archive.

What a user keeps is bounded: the bytes of their rows count against
TORCHYARD_MAX_BUNDLE_STORAGE_BYTES (`record_bundle` refuses past it), and a bundle nobody
uploaded again or named in a submitted job for TORCHYARD_BUNDLE_RETENTION_S, and that no
queued or running job or running sweep names, is removed (`remove_unused_bundles`, run by
the scheduler's tick through `remove_unused_bundles_due`): its rows, then its archive and
names file once no row of its id is left.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from torchyard.contracts.states import JOB_TERMINAL
from torchyard.settings import Settings
from torchyard.storage import Storage, storage_for
from torchyard.store.bundlefiles import MAX_NAMES_BYTES, archive_key, is_bundle_id, names_key
from torchyard.store.db import session_scope
from torchyard.store.models import Bundle, Job, Sweep, User, utcnow

log = logging.getLogger(__name__)

CLEANUP_EVERY_S = 3600.0  # how often the scheduler looks for unused bundles (at most)
CLEANUP_BATCH = 500  # rows looked at per clean-up (the next one takes the rest)
BUNDLE_PATH = "code.bundle"  # where a spec (or a sweep's space) names its bundle
# The largest names file read: the archive check bounds the names (MAX_NAMES_BYTES); JSON
# adds quotes and a comma a name and an escape for each '"' (backslashes and control
# characters are refused).
NAMES_FILE_MAX = 4 * MAX_NAMES_BYTES


class BundleQuotaExceeded(Exception):
    """An upload that would take its owner past TORCHYARD_MAX_BUNDLE_STORAGE_BYTES."""

    def __init__(self, used: int, size: int, quota: int):
        self.used, self.size, self.quota = used, size, quota
        super().__init__(
            f"your bundles take {used} bytes; this one ({size} bytes) would pass your "
            f"{quota} bytes (TORCHYARD_MAX_BUNDLE_STORAGE_BYTES); bundles unused for "
            "TORCHYARD_BUNDLE_RETENTION_S are removed"
        )


def get_bundle(session: Session, owner_id: int | None, bundle_id: str) -> Bundle | None:
    """The owner's row of the bundle, or None (also for a malformed id). `owner_id=None`:
    any owner's row (what an admin may see); the rows of one id differ only in owner."""
    if not is_bundle_id(bundle_id):
        return None
    if owner_id is not None:
        return session.get(Bundle, (bundle_id, owner_id))
    return session.scalar(select(Bundle).where(Bundle.id == bundle_id).limit(1))


def storage_used(session: Session, owner_id: int) -> int:
    """The bytes (as uploaded) of the bundles `owner_id` keeps."""
    used = session.scalar(select(func.sum(Bundle.bytes)).where(Bundle.owner_id == owner_id))
    return int(used or 0)


def record_bundle(
    session: Session,
    owner_id: int,
    bundle_id: str,
    bytes: int,
    files: int,
    quota: int | None = None,
) -> bool:
    """Record that `owner_id` uploaded the bundle; True when the row is new, False when it
    was there (it counts as used now). Idempotent, also under a race: two uploads of the
    same bytes at once both end with one row (the loser's insert fails on the primary key,
    in a savepoint, and it answers False). With `quota`: BundleQuotaExceeded when a new row
    would take the owner's bundles past it (read under the owner's row lock)."""
    now = utcnow()
    row = get_bundle(session, owner_id, bundle_id)
    if row is not None:
        row.last_used_at = now
        return False
    if quota is not None:
        session.scalar(select(User.id).where(User.id == owner_id).with_for_update())
        used = storage_used(session, owner_id)
        if used + bytes > quota:
            raise BundleQuotaExceeded(used, bytes, quota)
    try:
        with session.begin_nested():
            session.add(
                Bundle(
                    id=bundle_id,
                    owner_id=owner_id,
                    bytes=bytes,
                    files=files,
                    created_at=now,
                    last_used_at=now,
                )
            )
            session.flush()
    except IntegrityError:
        return False
    return True


def touch_bundles(session: Session, bundle_ids: Iterable[str]) -> None:
    """Mark the bundles used now (a job or sweep naming them was submitted): every row of
    each id, as an admin may name any user's bundle."""
    ids = sorted({b for b in bundle_ids if is_bundle_id(b)})
    if ids:
        session.execute(update(Bundle).where(Bundle.id.in_(ids)).values(last_used_at=utcnow()))


def spec_bundle(spec: Any) -> str | None:
    """The bundle a stored (or submitted) spec names, if any."""
    code = spec.get("code") if isinstance(spec, dict) else None
    bundle = code.get("bundle") if isinstance(code, dict) else None
    return bundle if isinstance(bundle, str) else None


def sweep_bundles(spec: Any, space: Any) -> set[str]:
    """The bundles a sweep's trials may name: its base spec's, and a `code.bundle`
    parameter's choices."""
    found = {b for b in [spec_bundle(spec)] if b}
    param = space.get(BUNDLE_PATH) if isinstance(space, dict) else None
    choices = param.get("choices") if isinstance(param, dict) else None
    if isinstance(choices, list):
        found |= {c for c in choices if isinstance(c, str)}
    return found


def write_bundle_names(storage: Storage, bundle_id: str, names: list[str]) -> None:
    """Write the names file atomically (the storage's write: a reader sees all of it or
    none, and an upload that dies half way leaves no half-written list behind). Its size is
    bounded by the archive check (bundlefiles.MAX_NAMES_BYTES, names in UTF-8 without
    control characters: JSON adds a few bytes a name)."""
    body = json.dumps(sorted(names), ensure_ascii=False, separators=(",", ":"))
    storage.write_bytes(names_key(bundle_id), body.encode())


def bundle_names(storage: Storage, bundle_id: str) -> list[str] | None:
    """The names of the bundle's files, or None when they are not on record (an unknown
    or malformed id, or a names file that is missing or unreadable)."""
    if not is_bundle_id(bundle_id):
        return None
    try:
        with storage.open_read(names_key(bundle_id)) as f:
            raw = f.read(NAMES_FILE_MAX + 1)
        if len(raw) > NAMES_FILE_MAX:  # written before names were bounded: not read whole
            return None
        names = json.loads(raw)
    except (OSError, ValueError):  # missing, refused (UnsafePath) or not JSON
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def _in_use(session: Session) -> set[str]:
    """The bundles named by a job that has not ended or by a running sweep."""
    live = session.scalars(select(Job.spec).where(Job.state.not_in(sorted(JOB_TERMINAL))))
    found = {b for b in map(spec_bundle, live) if b}
    for spec, space in session.execute(
        select(Sweep.spec, Sweep.space).where(Sweep.state == "running")
    ):
        found |= sweep_bundles(spec, space)
    return found


def remove_unused_bundles(
    session: Session, storage: Storage, retention_s: float, now: datetime | None = None
) -> list[str]:
    """Remove the rows not used for `retention_s` whose bundle nothing live names (at most
    CLEANUP_BATCH), commit, then the archive and names file of each id with no row left.
    Returns the ids whose files were removed. A race with an upload of the same bytes at
    that moment can leave that upload's row without its file: the submit check then says
    the bundle is not on record, and uploading it again restores it."""
    cutoff = (now or utcnow()) - timedelta(seconds=retention_s)
    used = func.coalesce(Bundle.last_used_at, Bundle.created_at)
    stale = session.execute(
        select(Bundle.id, Bundle.owner_id).where(used < cutoff).limit(CLEANUP_BATCH)
    ).all()
    if not stale:
        return []
    keep = _in_use(session)
    gone = [(bid, owner) for bid, owner in stale if bid not in keep]
    for bid, owner in gone:
        session.execute(delete(Bundle).where(Bundle.id == bid, Bundle.owner_id == owner))
    ids = sorted({bid for bid, _ in gone})
    left = set(session.scalars(select(Bundle.id).where(Bundle.id.in_(ids)))) if ids else set()
    session.commit()
    removed = [bid for bid in ids if bid not in left]
    for bid in removed:
        storage.delete(archive_key(bid))
        storage.delete(names_key(bid))
    return removed


_last_cleanup: dict[str, float] = {}
_cleanup_lock = threading.Lock()


def remove_unused_bundles_due(settings: Settings) -> int:
    """`remove_unused_bundles` when CLEANUP_EVERY_S have passed since this process last
    ran it for this database (the scheduler calls this every tick). Never raises: a failure
    is logged and retried at the next interval. Returns how many bundles were removed."""
    with _cleanup_lock:
        now = time.monotonic()
        last = _last_cleanup.get(settings.db_url)
        if last is not None and now - last < CLEANUP_EVERY_S:
            return 0
        _last_cleanup[settings.db_url] = now
    try:
        with session_scope(settings.db_url) as session:
            removed = remove_unused_bundles(
                session, storage_for(settings), settings.bundle_retention_s
            )
    except Exception as e:  # the next interval retries; never stop the caller's loop
        log.warning("removing unused bundles failed: %s", e)
        return 0
    if removed:
        log.info("removed %d bundles unused for %gs", len(removed), settings.bundle_retention_s)
    return len(removed)
