"""Tokens, job submission with idempotency, visibility, paging and cancel, in the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from support.db import SPEC, Factory

from torchyard.store import jobs
from torchyard.store.auth import TOKEN_PREFIX, create_token, hash_token, user_for_token
from torchyard.store.models import ApiToken, JobEvent
from torchyard.store.states import IllegalTransition

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


def test_tokens_are_stored_hashed(session: Session) -> None:
    token = create_token(session, "alice")
    assert token.startswith(TOKEN_PREFIX) and len(token) > 40
    stored = session.scalars(select(ApiToken)).all()
    assert len(stored) == 1 and stored[0].token_hash == hash_token(token)
    assert token not in {stored[0].token_hash, stored[0].prefix}
    user = user_for_token(session, token)
    assert user is not None and user.name == "alice" and not user.is_admin
    assert user_for_token(session, token + "x") is None
    assert user_for_token(session, "no-prefix") is None
    second = create_token(session, "alice", admin=True)  # same user, promoted
    assert second != token
    promoted = user_for_token(session, token)
    assert promoted is not None and promoted.is_admin


def test_token_create_prints_only_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchyard.settings import get_settings
    from torchyard.store.cli import token_main
    from torchyard.store.db import session_factory
    from torchyard.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(url)
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        assert token_main(["create", "--user", "dora", "--admin"]) == 0
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr().out
    token = out.strip()
    assert out == token + "\n"
    with session_factory(url)() as s:
        user = user_for_token(s, token)
        assert user is not None and user.name == "dora" and user.is_admin


def test_create_job_idempotency(session: Session, factory: Factory) -> None:
    uid = factory.user_id("alice")
    a, created = jobs.create_job(session, uid, SPEC, name="a", idempotency_key="k")
    assert created and a.state == "queued" and a.world_size == 1
    b, created = jobs.create_job(
        session, uid, dict(reversed(SPEC.items())), name="a", idempotency_key="k"
    )
    assert not created and b.id == a.id
    with pytest.raises(jobs.IdempotencyConflict):
        jobs.create_job(session, uid, SPEC | {"epochs": 9}, name="a", idempotency_key="k")
    c, created = jobs.create_job(session, uid, SPEC, name="a")
    assert created and c.id != a.id
    session.commit()
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == a.id)).all()
    assert [(e.type, e.data["to"]) for e in events] == [("state", "queued")]


def test_visibility_and_paging(session: Session, factory: Factory) -> None:
    mine = [factory.job("alice") for _ in range(3)]
    theirs = factory.job("bob")
    alice = jobs.Viewer(factory.user_id("alice"))
    root = jobs.Viewer(factory.user_id("root"), is_admin=True)
    assert jobs.get_job(session, alice, theirs) is None
    assert jobs.get_job(session, alice, mine[0]) is not None
    assert jobs.get_job(session, root, theirs) is not None
    page, cursor = jobs.list_jobs(session, alice, limit=2)
    assert [j.id for j, *_ in page] == mine[::-1][:2] and cursor
    page2, cursor2 = jobs.list_jobs(session, alice, limit=2, cursor=cursor)
    assert [j.id for j, *_ in page2] == [mine[0]] and cursor2 is None
    with pytest.raises(jobs.BadCursor):
        jobs.list_jobs(session, alice, cursor="Zm9v")


def test_cancel_follows_the_state_machine(session: Session, factory: Factory) -> None:
    viewer = jobs.Viewer(factory.user_id("alice"))
    queued = factory.job("alice")
    running = factory.job("alice", state="running")
    done = factory.job("alice", state="succeeded")
    for job_id, expected in ((queued, "cancelled"), (running, "cancelling")):
        found = jobs.get_job(session, viewer, job_id)
        assert found is not None
        job = jobs.request_cancel(session, found[0])
        assert job.state == expected and job.cancel_requested
        assert jobs.request_cancel(session, job).state == expected  # idempotent
    found = jobs.get_job(session, viewer, done)
    assert found is not None
    with pytest.raises(IllegalTransition):
        jobs.request_cancel(session, found[0])
