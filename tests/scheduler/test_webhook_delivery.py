"""Webhook delivery (scheduler/notify.py) to a real HTTP receiver, on SQLite and PostgreSQL.

In-process: the request (signature, headers), the SSRF guard at send time (every address a
name resolves to is checked; the connection goes to the checked address, whatever the
name resolves to later), redirects not followed.

End to end (`e2e`), with the real `torchyard scheduler` process: every event of jobs and
a sweep ending arrives signed; a receiver that answers 500 twice gets the delivery on the
third try, every try visible in GET /v1/webhooks/{id}/deliveries; and the sender killed
with SIGKILL mid-delivery: once restarted, every event arrives at least once, in order per
(webhook, job), a duplicate carrying the same X-Torchyard-Delivery."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support.webhook_receiver import receiver
from support.worker_factories import make_job, make_user

from torchyard.scheduler.notify import Notifier
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Job, Sweep, WebhookAttempt, WebhookDelivery, utcnow
from torchyard.store.states import transition
from torchyard.store.sweeps import cancel_sweep
from torchyard.store.webhooks import create_webhook

ROOT = Path(__file__).resolve().parents[2]
SECRET = "receiver-secret-0123456789"
ALL = ["job.succeeded", "job.failed", "job.cancelled", "sweep.completed"]
T = TypeVar("T")
RECEIVER_NET = "127.0.0.1/32"  # support/webhook_receiver.py's address


def _wait(cond: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _hook(url: str, target: str, events: list[str] = ALL, owner: str = "alice") -> str:
    with session_scope(url) as s:
        return create_webhook(s, make_user(s, owner).id, None, target, events, SECRET).id


def _end_job(url: str, to: str, name: str = "job", error: str | None = None) -> str:
    """A job of alice's, queued → … → `to` through the state machine."""
    with session_scope(url) as s:
        job = make_job(s, name=name)
        path = ["cancelled"] if to == "cancelled" else ["starting", "running", to]
        for state in path:
            transition(s, job, state, error=error if state == to else None)
        return job.id


def _sweep_cancelled(url: str) -> str:
    with session_scope(url) as s:
        sweep = Sweep(owner_id=make_user(s, "alice").id, name="sw", spec={}, space={},
                      metric="val/loss", mode="min", max_trials=1, parallel=1,
                      sampler="random", pruner="none", seed=0)  # fmt: skip
        s.add(sweep)
        s.flush()
        cancel_sweep(s, sweep)
        return sweep.id


def _settings(url: str, tmp: Path, **kw: Any) -> Settings:
    """The receiver listens on loopback, which webhooks reach only when allowed."""
    kw.setdefault("webhook_allow_networks", RECEIVER_NET)
    return Settings(_env_file=None, database_url=url, home=tmp, **kw)  # type: ignore[call-arg]


def _all_delivered(url: str) -> bool:
    with session_scope(url) as s:
        return all(s.scalars(select(WebhookDelivery.state == "delivered")))


def _attempts(url: str) -> list[WebhookAttempt]:
    with session_scope(url) as s:
        return list(s.scalars(select(WebhookAttempt).order_by(WebhookAttempt.id)))


# --- in-process: the request and the guard --------------------------------------------------


def test_a_signed_post_goes_to_the_checked_address(db_url: str, tmp_path: Path) -> None:
    """`hooks.example` resolves (through our resolver seam) to the receiver's address: the
    request goes there, with the name as Host; body, headers and signature as documented."""
    with receiver() as rx:
        _hook(db_url, f"http://hooks.example:{rx.port}/ok")
        job = _end_job(db_url, "failed", name="j1", error="out of memory")
        calls: list[tuple[str, int]] = []

        def resolver(host: str, port: int) -> list[str]:
            calls.append((host, port))
            return ["127.0.0.1"]

        sender = Notifier(_settings(db_url, tmp_path), resolver=resolver)
        try:
            assert sender.pass_once() == 1
        finally:
            sender.close()
        (r,) = rx.received()
    assert calls == [("hooks.example", rx.port)]
    assert r.headers["host"] == f"hooks.example:{rx.port}"
    assert r.headers["x-torchyard-event"] == "job.failed"
    assert r.headers["content-type"] == "application/json"
    assert r.signed_by(SECRET) and not r.signed_by(SECRET + "x")
    body = json.loads(r.body)
    assert body["event"] == "job.failed" and body["job"]["id"] == job
    assert body["job"]["error"] == "out of memory" and body["job"]["name"] == "j1"
    with session_scope(db_url) as s:
        (d,) = s.scalars(select(WebhookDelivery)).all()
    assert d.state == "delivered" and d.attempts == 1 and r.delivery == d.id


def test_a_name_resolving_to_a_denied_address_is_refused_at_send(
    db_url: str, tmp_path: Path
) -> None:
    """One of the name's addresses is in a denied network (cloud metadata): nothing is
    sent, to any of them; the try is recorded as failed with the reason."""
    with receiver() as rx:
        _hook(db_url, f"http://rebind.example:{rx.port}/ok")
        _end_job(db_url, "succeeded")
        sender = Notifier(
            _settings(db_url, tmp_path),
            resolver=lambda host, port: ["127.0.0.1", "169.254.169.254"],
        )
        try:
            sender.pass_once()
        finally:
            sender.close()
        assert rx.received() == []
    (a,) = _attempts(db_url)
    assert a.status_code is None and a.error is not None
    assert "refused" in a.error and "169.254.169.254" in a.error and "denied" in a.error


def test_loopback_denied_by_the_setting_and_redirects_not_followed(
    db_url: str, tmp_path: Path
) -> None:
    with receiver() as rx:
        _hook(db_url, f"http://localhost:{rx.port}/ok", ["job.succeeded"])
        _hook(db_url, f"{rx.url}/redirect", ["job.failed"])
        _end_job(db_url, "succeeded")
        _end_job(db_url, "failed")
        settings = _settings(db_url, tmp_path, webhook_deny_networks="127.0.0.0/8,169.254.0.0/16")
        sender = Notifier(settings)
        try:
            sender.pass_once()
        finally:
            sender.close()
        assert rx.received() == []  # localhost is 127.0.0.1, denied; the literal too
        sender = Notifier(_settings(db_url, tmp_path))
        with session_scope(db_url) as s:  # retry at once
            for d in s.scalars(select(WebhookDelivery)):
                d.next_attempt_at = utcnow()
        try:
            sender.pass_once()
        finally:
            sender.close()
        assert sorted(r.path for r in rx.received()) == ["/ok", "/redirect"]  # not /ok twice
    errors = sorted(a.error or "" for a in _attempts(db_url))
    assert any("refused" in e and "127.0.0.1" in e for e in errors)
    assert "HTTP 302" in errors


def test_the_sender_removes_old_ended_deliveries_hourly(db_url: str, tmp_path: Path) -> None:
    """At its first pass, then once an hour: deliveries sent past the retention go; a
    retention of 0 keeps them all."""
    with receiver() as rx:
        _hook(db_url, f"{rx.url}/ok", ["job.succeeded"])
        for i in range(3):
            _end_job(db_url, "succeeded", name=f"j{i}")
        sender = Notifier(_settings(db_url, tmp_path, webhook_retention_s=86_400.0))
        try:
            assert sender.clean_due() == 0  # nothing old yet; the hour starts now
            assert sender.pass_once() == 3 and _all_delivered(db_url)
            with session_scope(db_url) as s:
                for d in s.scalars(select(WebhookDelivery)):
                    d.created_at = utcnow() - timedelta(days=2)
            assert sender.clean_due() == 0  # within the hour
            keeper = Notifier(_settings(db_url, tmp_path, webhook_retention_s=0))
            assert keeper.clean_due() == 0  # 0: kept forever
            keeper.close()
            sender._cleaned_at = time.monotonic() - 3601
            assert sender.clean_due() == 3
        finally:
            sender.close()
    assert _attempts(db_url) == []


# --- end to end: the scheduler process ----------------------------------------------------


@contextlib.contextmanager
def scheduler_process(url: str, tmp: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """`start()` runs a `torchyard scheduler` (fast webhook settings) on the database; every
    one started is killed at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_HOME=str(tmp / "home"), TORCHYARD_DATABASE_URL=url,
               TORCHYARD_QUEUE_PREFIX=f"tyw-{uuid.uuid4().hex[:10]}",
               TORCHYARD_WEBHOOK_POLL_S="0.2", TORCHYARD_WEBHOOK_TIMEOUT_S="0.5",
               TORCHYARD_WEBHOOK_RETRY_BASE_S="0.3", PYTHONUNBUFFERED="1",
               TORCHYARD_WEBHOOK_ALLOW_NETWORKS=RECEIVER_NET)  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        log = open(tmp / f"scheduler{len(procs)}.log", "ab")  # noqa: SIM115 (the child's)
        p = subprocess.Popen([sys.executable, "-m", "torchyard", "scheduler"], cwd=ROOT,
                             env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)  # fmt: skip
        log.close()
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _deliveries_route(url: str, tmp: Path, hook: str) -> list[dict[str, Any]]:
    from torchyard.api.app import create_app
    from torchyard.store.auth import create_token

    with session_scope(url) as s:
        token = create_token(s, "alice")
    with TestClient(create_app(_settings(url, tmp / "api"))) as c:
        r = c.get(f"/v1/webhooks/{hook}/deliveries", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        return list(r.json()["items"])


@pytest.mark.e2e
def test_every_event_arrives_signed_and_a_flaky_receiver_gets_it_on_the_third_try(
    db_url: str, tmp_path: Path
) -> None:
    with receiver() as rx, scheduler_process(db_url, tmp_path) as start:
        _hook(db_url, f"{rx.url}/ok")
        flaky = _hook(db_url, f"{rx.url}/flaky", ["job.failed"])
        start()
        ok = _end_job(db_url, "succeeded")
        bad = _end_job(db_url, "failed", error="nonfinite loss")
        gone = _end_job(db_url, "cancelled")
        sweep = _sweep_cancelled(db_url)
        _wait(lambda: len(rx.received("/ok")) >= 4, 20, "the four events")
        _wait(lambda: len(rx.received("/flaky")) >= 3, 20, "three tries of the flaky one")
        _wait(lambda: _all_delivered(db_url), 10, "the answers recorded")
    got = {(json.loads(r.body).get("job") or json.loads(r.body)["sweep"])["id"]:
           r for r in rx.received("/ok")}  # fmt: skip
    assert set(got) == {ok, bad, gone, sweep}
    for subject, event in ((ok, "job.succeeded"), (bad, "job.failed"),
                           (gone, "job.cancelled"), (sweep, "sweep.completed")):  # fmt: skip
        r = got[subject]
        assert r.headers["x-torchyard-event"] == event and r.signed_by(SECRET)
        assert len(r.headers["x-torchyard-delivery"]) == 32
    assert json.loads(got[sweep].body)["sweep"]["state"] == "cancelled"
    tries = rx.received("/flaky")
    assert len({r.delivery for r in tries}) == 1 and len(tries) == 3  # one delivery, retried
    (d,) = _deliveries_route(db_url, tmp_path, flaky)
    assert d["state"] == "delivered" and d["id"] == tries[0].delivery
    assert [a["status_code"] for a in d["attempts"]] == [500, 500, 200]
    assert [a["error"] for a in d["attempts"]] == ["HTTP 500", "HTTP 500", None]


@pytest.mark.e2e
def test_a_sender_killed_mid_delivery_loses_nothing(db_url: str, tmp_path: Path) -> None:
    """The receiver holds the first request open; the scheduler is SIGKILLed meanwhile and
    started again. The held delivery is sent again once its lease expires, with the same
    X-Torchyard-Delivery; the one queued behind it for the same job waits for it; the
    other jobs' events arrive too."""
    with receiver() as rx, scheduler_process(db_url, tmp_path) as start:
        hook = _hook(db_url, f"{rx.url}/hold", ["job.failed"])
        first = _end_job(db_url, "failed")
        with session_scope(db_url) as s:  # a later event of the same job, behind it
            s.add(WebhookDelivery(id=uuid.uuid4().hex, webhook_id=hook, event="job.failed",
                                  subject=first, payload={"n": 2}, state="pending",
                                  next_attempt_at=utcnow(), created_at=utcnow()))  # fmt: skip
        proc = start()
        assert rx.held.wait(20), "the first delivery never arrived"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        others = [_end_job(db_url, "failed") for _ in range(3)]  # while no sender runs
        start()
        _wait(lambda: len({r.delivery for r in rx.received()}) >= 5, 25, "every delivery")
        _wait(lambda: _all_delivered(db_url), 10, "the answers recorded")
    got = rx.received()
    with session_scope(db_url) as s:
        rows = list(s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.seq)))
        assert all(d.state == "delivered" for d in rows)
        subjects = {d.id: d.subject for d in rows}
        assert s.scalar(select(Job.state).where(Job.id == first)) == "failed"
    assert {subjects[r.delivery] for r in got} == {first, *others}
    held = rows[0].id
    assert [r.delivery for r in got].count(held) >= 2  # sent again after the kill
    of_first = [r.delivery for r in got if subjects[r.delivery] == first]
    assert of_first.index(rows[1].id) > max(i for i, d in enumerate(of_first) if d == held)
    # every copy of a delivery is the same bytes, signed the same way
    for d in {r.delivery for r in got}:
        copies = {(r.body, r.headers["x-torchyard-signature"]) for r in got if r.delivery == d}
        assert len(copies) == 1
