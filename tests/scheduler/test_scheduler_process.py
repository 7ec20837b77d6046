"""The scheduler process (scheduler/process.py) in-process, its messages caught instead of
sent: the reconciler (lost assignment messages re-sent, assignments of workers that went
away handed back), the claim deadline, and the reaper's patience after a store outage."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.scheduler.process import Scheduler
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Attempt, Job, Worker, utcnow
from torchyard.store.workers import heartbeat


class _Sent(Scheduler):
    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.sent: list[tuple[int, str]] = []

    def _send(self, assignment_id: int, queue: str) -> bool:
        self.sent.append((assignment_id, queue))
        return True


def test_reconciler_resends_lost_messages_and_hands_back_gone_workers(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = Settings(_env_file=None, database_url=sqlite_url, home=tmp_path)  # type: ignore[call-arg]
    sched = _Sent(settings)
    with session_scope(sqlite_url) as s:
        make_worker(s, "w1")
        make_worker(s, "w2")
        a = make_job(s, name="a")
        b = make_job(s, name="b", age_s=-1)
    assert len(sched.schedule_pass()) == 2
    assert len(sched.sent) == 2
    sched.sent.clear()
    with session_scope(sqlite_url) as s:
        # Both messages were lost; w2 then stopped before taking its assignment.
        old = utcnow() - timedelta(seconds=10)  # past the re-send delay, not the claim deadline
        s.execute(update(Assignment).values(created_at=old))
        s.execute(update(Worker).where(Worker.id == "w2").values(state="stopped"))
        on_w2 = s.query(Assignment).filter_by(worker_id="w2").one().job_id
    assert sched.reconcile() == 1
    assert [q for _, q in sched.sent] == ["q.w1"]
    assert sched.reconcile() == 0  # not again right away
    with session_scope(sqlite_url) as s:
        j = s.get(Job, on_w2)
        assert j is not None and j.state == "queued" and j.attempt == 2
        assert "went away" in (j.pending_reason or "")
        assert {a.id, b.id} >= {on_w2}


def test_claim_deadline_gives_the_job_to_another_worker(sqlite_url: str, tmp_path: Path) -> None:
    """A worker whose consumer hangs (heartbeat alive, message never taken) used to keep its
    job `starting` forever while the reconciler re-sent. Past the claim deadline the attempt
    is handed back (not counted), the job starts on another worker, and the silent worker
    is lost until it registers again."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=sqlite_url,
        home=tmp_path,
        claim_timeout_s=5,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=0.5,
    )
    sched = _Sent(settings)
    sched.tick()  # the deadline applies once the store has answered for a heartbeat timeout
    time.sleep(0.6)
    with session_scope(sqlite_url) as s:
        make_worker(s, "w1")
        job = make_job(s, name="a")
    assert [q for _, q in (sched.schedule_pass() and sched.sent)] == ["q.w1"]
    with session_scope(sqlite_url) as s:
        make_worker(s, "w2")
        s.execute(update(Assignment).values(created_at=utcnow() - timedelta(seconds=6)))
    sched.reconcile()
    with session_scope(sqlite_url) as s:
        j = s.get(Job, job.id)
        assert j is not None and j.state == "queued" and j.attempt == 2
        assert "did not claim" in (j.pending_reason or "")
        w1 = s.get(Worker, "w1")
        assert w1 is not None and w1.state == "lost"
        att = s.query(Attempt).filter_by(job_id=job.id, number=1).one()
        assert att.state == "handed_back"  # not counted against max_restarts
    sched.sent.clear()
    with session_scope(sqlite_url) as s:  # w2 is alive: on a loaded host 0.5 s has passed
        heartbeat(s, "w2")
    out = sched.schedule_pass()
    assert [(d.job_id, d.worker_id) for d in out] == [(job.id, "w2")]


def test_reaper_waits_a_full_timeout_after_the_store_returns(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No heartbeat can be written during an outage: the first reaper pass after it used to
    declare busy workers lost. The reaper now acts only once the store has answered the
    scheduler for a full heartbeat timeout."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=sqlite_url,
        home=tmp_path,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=1.0,
    )
    with session_scope(sqlite_url) as s:  # a job scheduled onto w1: w1 is busy
        make_worker(s, "w1")
        make_job(s)
        schedule(s, heartbeat_timeout_s=10)
    with session_scope(sqlite_url) as s:  # the outage: w1 could not heartbeat for a minute
        s.execute(update(Worker).values(last_heartbeat=utcnow() - timedelta(seconds=60)))
    sched = Scheduler(settings)
    monkeypatch.setattr(sched, "_send", lambda *_: True)
    sched.tick()  # the store answers again
    with session_scope(sqlite_url) as s:
        assert s.get(Worker, "w1").state == "busy"  # type: ignore[union-attr]
    with session_scope(sqlite_url) as s:  # w1 heartbeats as soon as it can
        heartbeat(s, "w1")
    time.sleep(0.6)
    sched.tick()
    with session_scope(sqlite_url) as s:
        assert s.get(Worker, "w1").state == "busy"  # type: ignore[union-attr]
    time.sleep(0.6)  # now w1 really is silent for longer than the timeout
    sched.tick()
    with session_scope(sqlite_url) as s:
        assert s.get(Worker, "w1").state == "lost"  # type: ignore[union-attr]
