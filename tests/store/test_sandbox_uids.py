"""store/sandboxuids.py: each user's sandbox uid, given once from the range after
TORCHYARD_SANDBOX_UID, never another user's, and safe when workers give uids at once (the
unique constraints and a retry), on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from support.db import Factory

from torchyard.settings import Settings
from torchyard.store import sandboxuids
from torchyard.store.sandboxuids import NoSandboxUid, allocate, sandbox_uid

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


def test_a_users_uid_is_given_once_and_kept(factory: Factory, settings: Settings) -> None:
    alice, bob = factory.user_id("alice"), factory.user_id("bob")
    first = settings.sandbox_uid + 1
    a = sandbox_uid(settings, alice)
    assert a == first and sandbox_uid(settings, alice) == a
    sandboxuids._known.clear()  # another process: read from the store, the same uid
    assert sandbox_uid(settings, alice) == a
    assert sandbox_uid(settings, bob) == first + 1
    assert sandbox_uid(settings, None) is None  # no user: TORCHYARD_SANDBOX_UID itself
    # A range moved past them gives the next users uids there; old ones are kept.
    moved, carol = settings.sandbox_uid + 501, factory.user_id("carol")
    assert allocate(settings.db_url, carol, moved, 10) == moved
    assert allocate(settings.db_url, alice, moved, 10) == a


def test_a_full_range_is_refused_with_the_setting_named(factory: Factory) -> None:
    users = [factory.user_id(n) for n in ("u1", "u2", "u3")]
    assert [allocate(factory.url, u, 70000, 2) for u in users[:2]] == [70000, 70001]
    with pytest.raises(NoSandboxUid, match="TORCHYARD_SANDBOX_UID_COUNT"):
        allocate(factory.url, users[2], 70000, 2)


def test_workers_giving_uids_at_once_never_share_one(factory: Factory) -> None:
    """Eight threads (workers) at once, two per user: one uid per user, four distinct."""
    users = [factory.user_id(f"racer{i}") for i in range(4)]
    barrier = threading.Barrier(8)
    got: dict[int, list[int]] = {u: [] for u in users}
    errors: list[BaseException] = []

    def give(user: int) -> None:
        try:
            barrier.wait(10)
            got[user].append(allocate(factory.url, user, 80000, 100))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=give, args=(u,)) for u in users * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(len(set(uids)) == 1 and len(uids) == 2 for uids in got.values()), got
    assert len({uids[0] for uids in got.values()}) == 4
