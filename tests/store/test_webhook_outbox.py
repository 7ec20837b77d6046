"""The webhook outbox (store/webhooks.py): deliveries written in the transaction of the
state change that causes them (and gone with it when it rolls back), one per subscribed
webhook of the job's owner or project; the sender's claim (lease, order per webhook and
subject) and its record of each try (backoff, giving up after a day)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session
from support.db import Factory

from torchyard.store.db import session_scope
from torchyard.store.models import Job, Sweep, WebhookAttempt, WebhookDelivery, utcnow
from torchyard.store.projects import create_project, personal_project_id, set_member
from torchyard.store.states import (
    CANCELLED,
    FAILED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    transition,
    transition_many,
)
from torchyard.store.sweeps import cancel_sweep
from torchyard.store.webhooks import (
    BACKOFF,
    Outcome,
    claim_due,
    create_webhook,
    record_attempt,
    remove_ended_deliveries,
    retry_delay,
)

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


def _hook(url: str, owner: int, events: list[str], project: int | None = None) -> str:
    with session_scope(url) as s:
        return create_webhook(s, owner, project, "http://127.0.0.1:9/h", events, "s" * 16).id


def _deliveries(url: str) -> list[WebhookDelivery]:
    with session_scope(url) as s:
        return list(s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.seq)))


def test_a_job_end_writes_one_delivery_per_subscribed_webhook(
    factory: Factory, db_url: str
) -> None:
    alice, bob = factory.user_id("alice"), factory.user_id("bob")
    mine = _hook(db_url, alice, ["job.failed", "job.succeeded"])
    only_ok = _hook(db_url, alice, ["job.succeeded"])
    _hook(db_url, bob, ["job.failed"])  # another user's: not about alice's jobs
    with session_scope(db_url) as s:
        lab = create_project(s, "lab", alice)
        set_member(s, lab, _user(s, bob), "owner")
        lab_id = lab.id
    team = _hook(db_url, bob, ["job.failed"], project=lab_id)
    personal = factory.job("alice", RUNNING)
    in_lab = factory.job("alice", RUNNING, project_id=lab_id)
    factory.set_state(personal, FAILED, error="boom")
    factory.set_state(in_lab, FAILED)
    got = {(d.webhook_id, d.subject, d.event) for d in _deliveries(db_url)}
    assert got == {
        (mine, personal, "job.failed"),
        (mine, in_lab, "job.failed"),  # alice's own job, whatever its project
        (team, in_lab, "job.failed"),  # the project's webhook
    }
    assert only_ok not in {w for w, _, _ in got}
    first = _deliveries(db_url)[0]
    assert len(first.id) == 32 and first.state == "pending" and first.attempts == 0
    job = first.payload["job"]
    assert first.payload["event"] == "job.failed"
    assert job["id"] == personal and job["state"] == "failed" and job["error"] == "boom"
    assert job["owner"] == "alice" and job["project"] == "~alice" and job["attempt"] == 1
    assert job["finished_at"] and job["name"]


def _user(s: Session, uid: int):  # type: ignore[no-untyped-def]
    from torchyard.store.models import User

    return s.get(User, uid)


def test_transition_many_writes_every_jobs_delivery_in_one_go(
    factory: Factory, db_url: str
) -> None:
    alice = factory.user_id("alice")
    hook = _hook(db_url, alice, ["job.cancelled"])
    jobs = [factory.job("alice") for _ in range(3)]
    with session_scope(db_url) as s:
        assert transition_many(s, [(j, 1, "test") for j in jobs], "queued", CANCELLED)
    ds = _deliveries(db_url)
    assert sorted(d.subject for d in ds) == sorted(jobs)
    assert {d.webhook_id for d in ds} == {hook} and len({d.id for d in ds}) == 3
    assert all(d.payload["job"]["state"] == "cancelled" for d in ds)


def test_a_rolled_back_transition_leaves_no_delivery(factory: Factory, db_url: str) -> None:
    alice = factory.user_id("alice")
    _hook(db_url, alice, ["job.succeeded"])
    jid = factory.job("alice", RUNNING)
    with pytest.raises(RuntimeError), session_scope(db_url) as s:
        job = s.get(Job, jid)
        assert job is not None
        transition(s, job, SUCCEEDED)
        assert s.scalar(select(WebhookDelivery.id)) is not None  # written, in this transaction
        raise RuntimeError("the caller fails before its commit")
    assert _deliveries(db_url) == []
    with session_scope(db_url) as s:
        assert s.get(Job, jid).state == RUNNING  # type: ignore[union-attr]


def test_no_delivery_for_states_that_are_not_endings_or_inactive_hooks(
    factory: Factory, db_url: str
) -> None:
    alice = factory.user_id("alice")
    hook = _hook(db_url, alice, ["job.succeeded", "job.failed", "job.cancelled"])
    factory.job("alice", STARTING)
    factory.job("alice", RUNNING)
    assert _deliveries(db_url) == []
    with session_scope(db_url) as s:
        from torchyard.store.models import Webhook

        s.execute(update(Webhook).where(Webhook.id == hook).values(active=False))
    factory.job("alice", SUCCEEDED)
    assert _deliveries(db_url) == []


def test_every_sweep_ending_fires_sweep_completed(factory: Factory, db_url: str) -> None:
    alice = factory.user_id("alice")
    hook = _hook(db_url, alice, ["sweep.completed"])
    with session_scope(db_url) as s:
        sweep = Sweep(owner_id=alice, name="sw", spec={}, space={}, metric="val/loss",
                      mode="min", max_trials=1, parallel=1, sampler="random", pruner="none",
                      seed=0, project_id=personal_project_id(s, alice))  # fmt: skip
        s.add(sweep)
        s.flush()
        assert cancel_sweep(s, sweep)
    (d,) = _deliveries(db_url)
    assert d.webhook_id == hook and d.event == "sweep.completed" and d.subject == sweep.id
    body = d.payload["sweep"]
    assert body["state"] == "cancelled" and body["owner"] == "alice" and body["name"] == "sw"
    assert body["project"] == "~alice"


def _outcome(code: int | None, error: str | None = None) -> Outcome:
    return Outcome(utcnow(), 5, code, error)


def test_claim_leases_and_keeps_the_order_of_each_webhook_and_subject(
    factory: Factory, db_url: str
) -> None:
    alice = factory.user_id("alice")
    _hook(db_url, alice, ["job.failed", "job.succeeded"])
    a, b = factory.job("alice", FAILED), factory.job("alice", SUCCEEDED)
    with session_scope(db_url) as s:  # a second event of job a (say, after a re-run)
        first = s.scalar(select(WebhookDelivery).where(WebhookDelivery.subject == a))
        assert first is not None
        s.add(WebhookDelivery(id="f" * 32, webhook_id=first.webhook_id, event="job.succeeded",
                              subject=a, payload={"n": 2}, state="pending",
                              next_attempt_at=utcnow()))  # fmt: skip
    with session_scope(db_url) as s:
        got = claim_due(s, "one", lease_s=60, limit=10)
    assert sorted(d.payload["job"]["id"] for d in got) == sorted([a, b])  # a's second waits
    with session_scope(db_url) as s:
        assert claim_due(s, "two", lease_s=60, limit=10) == []  # leased
    due_a = next(d for d in got if d.payload["job"]["id"] == a)
    with session_scope(db_url) as s:
        assert record_attempt(s, due_a, "one", _outcome(204), base_s=10) == "delivered"
    with session_scope(db_url) as s:
        (second,) = claim_due(s, "two", lease_s=60, limit=10)
    assert second.id == "f" * 32
    with session_scope(db_url) as s:  # "two" died: its lease expires, the next claim has it
        s.execute(update(WebhookDelivery).values(lease_until=utcnow() - timedelta(seconds=1)))
    with session_scope(db_url) as s:
        again = claim_due(s, "three", lease_s=60, limit=10)
    assert second.id in {d.id for d in again}


def test_failures_back_off_then_give_up_after_a_day(factory: Factory, db_url: str) -> None:
    alice = factory.user_id("alice")
    _hook(db_url, alice, ["job.failed"])
    factory.job("alice", FAILED)
    with session_scope(db_url) as s:
        (due,) = claim_due(s, "me", lease_s=60, limit=10)
        assert record_attempt(s, due, "me", _outcome(500, "HTTP 500"), base_s=10) == "pending"
    (d,) = _deliveries(db_url)
    wait = (d.next_attempt_at - utcnow()).total_seconds()
    assert 7 < wait <= 12 and d.attempts == 1 and d.last_status_code == 500
    assert d.lease_until is None and d.last_error == "HTTP 500"
    with session_scope(db_url) as s:
        assert claim_due(s, "me", lease_s=60, limit=10) == []  # not due yet
        s.execute(update(WebhookDelivery).values(next_attempt_at=utcnow()))
    with session_scope(db_url) as s:  # a lost claim records the try, changes nothing else
        (due,) = claim_due(s, "me", lease_s=60, limit=10)
        assert record_attempt(s, due, "someone-else", _outcome(None, "refused"), 10) == "pending"
    with session_scope(db_url) as s:
        old = utcnow() - timedelta(days=1)
        s.execute(update(WebhookDelivery).values(created_at=old, lease_until=None,
                                                 next_attempt_at=utcnow()))  # fmt: skip
    with session_scope(db_url) as s:
        (due,) = claim_due(s, "me", lease_s=60, limit=10)
        assert record_attempt(s, due, "me", _outcome(None, "timed out"), base_s=10) == "failed"
    (d,) = _deliveries(db_url)
    assert d.state == "failed" and d.attempts == 2
    with session_scope(db_url) as s:
        tries = list(s.scalars(select(WebhookAttempt).order_by(WebhookAttempt.id)))
    assert [(t.status_code, t.error) for t in tries] == [
        (500, "HTTP 500"),
        (None, "refused"),
        (None, "timed out"),
    ]


def test_ended_deliveries_past_the_retention_go_with_their_tries(
    factory: Factory, db_url: str
) -> None:
    """Sent and given-up deliveries older than the retention are removed (tries too), in
    bounded batches; pending ones, however old, and recent ones stay."""
    alice = factory.user_id("alice")
    _hook(db_url, alice, ["job.failed", "job.succeeded"])
    jobs = [factory.job("alice", FAILED) for _ in range(4)] + [factory.job("alice", SUCCEEDED)]
    with session_scope(db_url) as s:
        for due in claim_due(s, "me", lease_s=60, limit=10):
            record_attempt(s, due, "me", _outcome(204), base_s=10)
    by_job = {d.subject: d.id for d in _deliveries(db_url)}
    old, recent_sent, old_pending = jobs[:3], jobs[3], jobs[4]
    with session_scope(db_url) as s:
        long_ago = utcnow() - timedelta(days=40)
        s.execute(update(WebhookDelivery).where(WebhookDelivery.subject.in_(old))
                  .values(created_at=long_ago))  # fmt: skip
        s.execute(update(WebhookDelivery).where(WebhookDelivery.subject == old[2])
                  .values(state="failed"))  # fmt: skip
        s.execute(update(WebhookDelivery).where(WebhookDelivery.subject == old_pending)
                  .values(created_at=long_ago, state="pending"))  # fmt: skip
    keep_s = 30 * 86_400.0
    with session_scope(db_url) as s:
        assert remove_ended_deliveries(s, keep_s, limit=2) == 2  # the oldest two first
    with session_scope(db_url) as s:
        assert remove_ended_deliveries(s, keep_s, limit=2) == 1
    with session_scope(db_url) as s:
        assert remove_ended_deliveries(s, keep_s) == 0
        tries = set(s.scalars(select(WebhookAttempt.delivery_id)))
    left = {d.subject for d in _deliveries(db_url)}
    assert left == {recent_sent, old_pending}
    assert tries == {by_job[recent_sent], by_job[old_pending]}


def test_retry_delays_grow_to_an_hour_with_jitter() -> None:
    rng = random.Random(1)
    for n, factor in enumerate(BACKOFF, start=1):
        d = retry_delay(n, 10, rng)
        assert factor * 8 <= d <= factor * 12
    assert retry_delay(50, 10, rng) <= 3600 * 1.2
    assert [round(retry_delay(n, 10, random.Random(0)) / 10) for n in (1, 2, 3)] != [0, 0, 0]
