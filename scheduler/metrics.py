"""The scheduler process's Prometheus metrics (`torchyard_scheduler_*`), in a registry of its
own, served on TORCHYARD_METRICS_PORT or `--metrics-port` (off by default) at
TORCHYARD_METRICS_ADDR. Counted as the process goes: each pass's duration and jobs placed,
each rank's dispatch latency, the reaper's and the reconciler's actions, failed tick steps.
Read from the store at scrape time (one read-only transaction, never SQLite's write lock):
the queue's depth and its longest wait by priority, and each worker's heartbeat age.
The metric list and the alert rules over it: docs/monitoring.md."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from torchyard.store.db import make_engine
from torchyard.store.dialect import db_now
from torchyard.store.models import Attempt, Job, UTCDateTime, Worker
from torchyard.store.states import QUEUED
from torchyard.store.workers import BUSY, IDLE, LOST

log = logging.getLogger(__name__)

P = "torchyard_scheduler_"
# The label values of the action counters, all exported from the start (at 0): a rate()
# over a series that appears only at its first increment misses that increment.
REAPER_ACTIONS = ("worker_lost", "attempt_lost", "worker_released")
RECONCILER_ACTIONS = ("handed_back", "claim_expired", "resent")
TICK_STEPS = ("reap", "reconcile", "sweep_pass", "schedule_pass")
# Workers whose heartbeat age is exported: a stopped one deregistered cleanly.
HEARTBEAT_STATES = (IDLE, BUSY, LOST)


class SchedulerMetrics:
    """The scheduler's registry and what its process counts into it."""

    def __init__(self, db_url: str | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pass_seconds = Histogram(
            P + "pass_duration_seconds",
            "one bounded scheduling pass: read, plan, write, commit and send its messages",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.jobs_placed = Histogram(
            P + "jobs_placed_per_pass",
            "jobs a scheduling pass started (every rank of each); _sum: jobs placed",
            registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.dispatch_latency = Histogram(
            P + "dispatch_latency_seconds",
            "per rank: from the start of the pass that placed it to its assignment message "
            "handed to the broker",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reaper = _counter(r, "reaper_actions", "what the reaper did", "action", REAPER_ACTIONS)
        self.reconciler = _counter(
            r, "reconciler_actions", "what the reconciler did", "action", RECONCILER_ACTIONS
        )
        self.step_failures = _counter(
            r, "step_failures", "steps (of a tick, or a wake-up's pass) that raised", "step",
            TICK_STEPS,
        )  # fmt: skip
        if db_url is not None:
            r.register(StoreCollector(db_url))

    def pass_done(self, started: float, jobs: int) -> None:
        """One pass committed and sent; `started`: its time.monotonic() at the start."""
        self.pass_seconds.observe(time.monotonic() - started)
        self.jobs_placed.observe(jobs)

    def dispatched(self, started: float) -> None:
        """A rank's message was handed to the broker (or its send failed: the reconciler
        sends it again, counted there)."""
        self.dispatch_latency.observe(time.monotonic() - started)

    def reaped(self, workers_lost: int, attempts_lost: int, workers_released: int) -> None:
        for action, n in zip(
            REAPER_ACTIONS, (workers_lost, attempts_lost, workers_released), strict=True
        ):
            self.reaper.labels(action).inc(n)

    def reconciled(self, handed_back: int, claims_expired: int, resent: int) -> None:
        for action, n in zip(
            RECONCILER_ACTIONS, (handed_back, claims_expired, resent), strict=True
        ):
            self.reconciler.labels(action).inc(n)

    def step_failed(self, step: str) -> None:
        self.step_failures.labels(step).inc()


def _counter(
    registry: CollectorRegistry, name: str, doc: str, label: str, values: Iterable[str]
) -> Counter:
    c = Counter(P + name, doc, [label], registry=registry)
    for v in values:
        c.labels(v)
    return c


class StoreCollector(Collector):
    """The queue and the workers' heartbeats, read at scrape time on the database's clock."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self._sessions: sessionmaker[Session] | None = None  # made at the first scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily(P + "queue_depth", "queued jobs by priority", labels=["priority"])
        wait = GaugeMetricFamily(
            P + "oldest_queued_seconds",
            "by priority: seconds the longest-waiting queued job has waited (since its "
            "submit, or since its last attempt ended for a job queued again)",
            labels=["priority"],
        )
        heartbeat = GaugeMetricFamily(
            P + "worker_heartbeat_age_seconds",
            "seconds since each idle, busy or lost worker's last heartbeat",
            labels=["worker", "state"],
        )
        up = GaugeMetricFamily(P + "store_up", "1 when this scrape could read the store")
        try:
            if self._sessions is None:
                self._sessions = sessionmaker(make_engine(self.db_url, read_only=True))
            with self._sessions() as s:
                now = db_now(s)
                for priority, n, oldest in queue_by_priority(s):
                    depth.add_metric([str(priority)], n)
                    wait.add_metric([str(priority)], _age(now, oldest))
                for wid, state, beat in heartbeats(s):
                    heartbeat.add_metric([wid, state], _age(now, beat))
            up.add_metric([], 1)
        except Exception as e:  # a scrape must answer while the store is down
            log.warning("metrics: store unreachable: %s", e)
            up.add_metric([], 0)
        yield from (depth, wait, heartbeat, up)


def _age(now: datetime, then: datetime | None) -> float:
    return max(0.0, (now - then).total_seconds()) if then is not None else 0.0


def queue_by_priority(session: Session) -> list[tuple[int, int, datetime | None]]:
    """(priority, queued jobs, since when the longest-waiting one waits) per priority. A job
    queued again waits since its last attempt ended, not since its submit: a job that ran
    for hours and was handed back has not waited hours."""
    last_end = select(func.max(Attempt.ended_at)).where(Attempt.job_id == Job.id).scalar_subquery()
    since = case((Job.attempt > 1, func.coalesce(last_end, Job.created_at)), else_=Job.created_at)
    rows = session.execute(
        select(Job.priority, func.count(), func.min(since, type_=UTCDateTime))
        .where(Job.state == QUEUED)
        .group_by(Job.priority)
    ).all()
    return [(int(p), int(n), t) for p, n, t in rows]


def heartbeats(session: Session) -> list[tuple[str, str, datetime | None]]:
    """(worker id, state, last heartbeat) of every idle, busy or lost worker."""
    rows = session.execute(
        select(Worker.id, Worker.state, Worker.last_heartbeat).where(
            Worker.state.in_(HEARTBEAT_STATES)
        )
    ).all()
    return [(str(w), str(st), t) for w, st, t in rows]


def serve(registry: CollectorRegistry, port: int, addr: str, prog: str) -> bool:
    """Serve `registry` at http://addr:port/metrics from a daemon thread; False after saying
    why it cannot (the port taken, an address not on this host)."""
    try:
        start_http_server(port, addr, registry=registry)
    except OSError as e:
        print(
            f"{prog}: cannot serve metrics on {addr}:{port} ({e.strerror or e}); choose "
            "another --metrics-port (TORCHYARD_METRICS_PORT) or TORCHYARD_METRICS_ADDR",
            file=sys.stderr,
        )
        return False
    log.info("Prometheus metrics on http://%s:%d/metrics", addr, port)
    return True
