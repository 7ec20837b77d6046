"""The scheduler's Prometheus metrics (scheduler/metrics.py), in-process on both databases:
what a pass, the reaper and the reconciler count, and what a scrape reads from the store
(queue depth and wait by priority, heartbeat ages). Scraping the real process over HTTP is
tests/worker/test_worker_metrics.py's end-to-end test."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from promtext import Samples, labelled, parse, value
from sqlalchemy import update
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.metrics import StoreCollector, serve
from torchyard.scheduler.process import Scheduler
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Attempt, Worker, utcnow

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


class _Sent(Scheduler):
    """Messages caught instead of sent."""

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.sent: list[tuple[int, str]] = []

    def _send(self, assignment_id: int, queue: str) -> bool:
        self.sent.append((assignment_id, queue))
        return True


def _scrape(sched: Scheduler) -> Samples:
    return parse(generate_latest(sched.metrics.registry).decode())


def _settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path)  # type: ignore[call-arg]


def test_a_pass_and_the_queue_and_heartbeats_read_at_scrape_time(
    db_url: str, tmp_path: Path
) -> None:
    sched = _Sent(_settings(db_url, tmp_path))
    before = _scrape(sched)
    assert value(before, "torchyard_scheduler_pass_duration_seconds_count") == 0
    assert value(before, "torchyard_scheduler_store_up") == 1
    with session_scope(db_url) as s:
        make_worker(s, "w1")
        make_worker(s, "w2")
        make_worker(s, "gone", state="stopped")  # deregistered: no heartbeat age
        make_worker(s, "silent", state="lost", heartbeat=utcnow() - timedelta(seconds=100))
        make_job(s, name="a", age_s=30)
        make_job(s, name="b", age_s=20, world_size=2)  # waits: a took one of the two
        make_job(s, name="big", priority=5, age_s=60, world_size=3)  # never fits two workers
        # Queued again after an attempt that ended 10 s ago: it has waited 10 s, not 1000.
        again = make_job(s, name="again", priority=3, age_s=1000, world_size=3)
        again.attempt = 2
        s.add(Attempt(job_id=again.id, number=1, state="lost",
                      ended_at=utcnow() - timedelta(seconds=10)))  # fmt: skip
    placed = sched.schedule_pass()
    assert [d.rank for d in placed] == [0]
    m = _scrape(sched)
    passes = value(m, "torchyard_scheduler_pass_duration_seconds_count")
    assert passes >= 1 and value(m, "torchyard_scheduler_jobs_placed_per_pass_count") == passes
    assert value(m, "torchyard_scheduler_jobs_placed_per_pass_sum") == 1
    assert value(m, "torchyard_scheduler_jobs_placed_per_pass_bucket", le="0.0") == passes - 1
    assert value(m, "torchyard_scheduler_dispatch_latency_seconds_count") == 1
    assert 0 < value(m, "torchyard_scheduler_dispatch_latency_seconds_sum") < 5
    depth = labelled(m, "torchyard_scheduler_queue_depth", "priority")
    assert depth == {"0": 1, "3": 1, "5": 1}
    wait = labelled(m, "torchyard_scheduler_oldest_queued_seconds", "priority")
    assert 19 <= wait["0"] < 60 and 59 <= wait["5"] < 100 and 9 <= wait["3"] < 60
    ages = labelled(m, "torchyard_scheduler_worker_heartbeat_age_seconds", "worker")
    assert set(ages) == {"w1", "w2", "silent"}
    assert ages["w1"] < 10 and 99 <= ages["silent"] < 200
    assert value(
        m, "torchyard_scheduler_worker_heartbeat_age_seconds", worker="silent", state="lost"
    ) == ages["silent"]  # fmt: skip


def test_reaper_and_reconciler_actions_are_counted_by_kind(db_url: str, tmp_path: Path) -> None:
    sched = _Sent(_settings(db_url, tmp_path))
    m = _scrape(sched)
    for action in ("worker_lost", "attempt_lost", "worker_released"):
        assert value(m, "torchyard_scheduler_reaper_actions_total", action=action) == 0
    with session_scope(db_url) as s:
        make_worker(s, "w1")
        make_worker(s, "w2")
        make_worker(s, "w3")
        for name in ("a", "b", "c"):
            make_job(s, name=name)
    assert len(sched.schedule_pass()) == 3
    with session_scope(db_url) as s:
        # Every message lost; w2 then stopped before taking its assignment; w3 went silent.
        s.execute(update(Assignment).values(created_at=utcnow() - timedelta(seconds=10)))
        s.execute(update(Worker).where(Worker.id == "w2").values(state="stopped"))
        s.execute(
            update(Worker)
            .where(Worker.id == "w3")
            .values(last_heartbeat=utcnow() - timedelta(seconds=600))
        )
    sched._store_ok_since = time.monotonic() - 600  # the store answered for long enough
    assert sched.reap() == 1
    sched.reconcile()
    m = _scrape(sched)
    assert value(m, "torchyard_scheduler_reaper_actions_total", action="worker_lost") == 1
    assert value(m, "torchyard_scheduler_reaper_actions_total", action="attempt_lost") == 0
    assert value(m, "torchyard_scheduler_reconciler_actions_total", action="handed_back") == 1
    assert value(m, "torchyard_scheduler_reconciler_actions_total", action="resent") == 1
    assert value(m, "torchyard_scheduler_reconciler_actions_total", action="claim_expired") == 0


def test_a_scrape_answers_while_the_store_is_down() -> None:
    collector = StoreCollector("postgresql+psycopg://torchyard@127.0.0.1:1/none")
    families = {f.name: f for f in collector.collect()}
    assert families["torchyard_scheduler_store_up"].samples[0].value == 0
    assert families["torchyard_scheduler_queue_depth"].samples == []


def test_a_taken_port_is_said_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from prometheus_client import CollectorRegistry

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not serve(CollectorRegistry(), port, "127.0.0.1", "torchyard scheduler")
    err = capsys.readouterr().err
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "--metrics-port" in err
