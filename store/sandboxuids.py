"""Each user's sandbox uid: the host uid a root worker runs that user's trainers as
(worker/launch_sandbox.py), so that what the kernel keys by uid (keyrings, signals, file
ownership, /proc, per-user limits) is apart between users on one host.

A user's uid is given once, the first time one of their jobs launches, and recorded in
`sandbox_uids` (migration 0020): TORCHYARD_SANDBOX_UID + 1 upward, at most
TORCHYARD_SANDBOX_UID_COUNT of them. TORCHYARD_SANDBOX_UID itself is no user's: the slot's
first warm trainer, before any user is known, and jobs without an owner run as it. A row is
never removed and users are never deleted, so a uid never passes to another user.

Two workers giving uids at once: each reads the highest uid and inserts the next; the
primary key (one uid per user) and the unique uid make the second insert fail, and that
worker reads again (then finds the user's row, or the new highest uid). A user's uid never
changes, so each process keeps the ones it has read."""

from __future__ import annotations

import threading

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import SandboxUid

TRIES = 20  # inserts lost to other workers' at once before giving up
MAX_UID = 2**31 - 2
_known: dict[tuple[str, int], int] = {}  # (database URL, user id) -> uid
_lock = threading.Lock()


class NoSandboxUid(RuntimeError):
    """No uid could be given (the range is used up, or every try lost a race)."""


def sandbox_uid(settings: Settings, user_id: int | None) -> int | None:
    """The host uid `user_id`'s trainers run as (given now if they have none); None for no
    user (the worker then uses TORCHYARD_SANDBOX_UID)."""
    if user_id is None:
        return None
    key = (settings.db_url, user_id)
    with _lock:
        if key in _known:
            return _known[key]
    uid = allocate(settings.db_url, user_id, settings.sandbox_uid + 1, settings.sandbox_uid_count)
    with _lock:
        _known[key] = uid
    return uid


def allocate(url: str, user_id: int, first: int, count: int) -> int:
    """`user_id`'s uid: the recorded one, else the next free one of [first, first + count)
    recorded for them. NoSandboxUid when the range is used up."""
    for _ in range(TRIES):
        try:
            with session_scope(url) as s:
                found = s.scalar(select(SandboxUid.uid).where(SandboxUid.user_id == user_id))
                if found is not None:
                    return int(found)
                top = s.scalar(select(func.max(SandboxUid.uid)))
                uid = first if top is None else max(int(top) + 1, first)
                if uid >= first + count or uid > MAX_UID:
                    raise NoSandboxUid(
                        f"every sandbox uid of {first}..{first + count - 1} is another user's: "
                        "raise TORCHYARD_SANDBOX_UID_COUNT"
                    )
                s.add(SandboxUid(user_id=user_id, uid=uid))
            return uid
        except IntegrityError:
            continue  # another worker recorded this user, or took this uid: read again
    raise NoSandboxUid(f"no sandbox uid recorded for user {user_id} after {TRIES} tries")
