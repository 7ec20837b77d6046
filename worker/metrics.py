"""A worker process's Prometheus metrics (`torchyard_worker_*`), in a registry of its own (no
`worker` label: each worker serves its own, on TORCHYARD_METRICS_PORT or `--metrics-port`,
off by default, at TORCHYARD_METRICS_ADDR; `torchyard_worker_info` names the worker behind
the address). Counted as the worker goes: trainers started and restarted, attempts ended by
outcome (handed back among them). Read from the running assignment at scrape time, from
another thread (every read is of a copy or a single attribute; the supervision takes the
one lock only as an assignment starts and ends): the worker's state, its current job, the
ingest lag (events the trainer wrote that are not in the store yet, and how old the oldest
is), event lines set aside, and the uploads still going to an object store. The list:
docs/monitoring.md."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from torchyard.contracts.states import AttemptState
from torchyard.store.attempts import Claimed
from torchyard.worker.events import EventRecorder, EventTail
from torchyard.worker.publish import CheckpointUploads, LogShipper

log = logging.getLogger(__name__)

P = "torchyard_worker_"
# `starting`: not registered yet; `lost`: the store says so (it gave this worker's job away
# and waits for it to register again); `stopping`: SIGTERM seen, no new work.
STATES = ("starting", "idle", "busy", "lost", "stopping")
OUTCOMES = tuple(
    s.value for s in AttemptState if s not in (AttemptState.STARTING, AttemptState.RUNNING)
)


class Supervised(Protocol):
    """What the metrics read of a running assignment (worker/supervisor.py Supervision)."""

    c: Claimed
    recorder: EventRecorder
    events_path: Path
    uploads: CheckpointUploads | None
    shipper: LogShipper | None


class WorkerMetrics:
    """The worker's registry and what its process counts into it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.trainer_starts = Counter(
            P + "trainer_starts", "trainers this worker started", registry=self.registry
        )
        self.trainer_restarts = Counter(
            P + "trainer_restarts",
            "trainers started for a job's attempt after its first (the job restarted after a "
            "lost, failed, preempted or handed-back attempt, from its last checkpoint)",
            registry=self.registry,
        )
        self.attempts_ended = Counter(
            P + "attempts_ended",
            "attempts whose end this worker recorded, by outcome (handed_back: given back "
            "to the queue uncounted, e.g. on a stop or a preemption)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.attempts_ended.labels(outcome)
        self.state_of: Callable[[], str] = lambda: "starting"  # the node sets its own
        self.identity: dict[str, str] = {}
        self._lock = threading.Lock()  # `running` and `_set_aside_before` change together
        self.running: Supervised | None = None
        self._set_aside_before = 0  # lines set aside by the assignments that ended
        self.registry.register(_Live(self))

    def trainer_started(self, attempt_number: int) -> None:
        self.trainer_starts.inc()
        if attempt_number > 1:
            self.trainer_restarts.inc()

    def attempt_ended(self, outcome: str) -> None:
        self.attempts_ended.labels(outcome).inc()

    @contextlib.contextmanager
    def supervising(self, sup: Supervised) -> Iterator[None]:
        """`sup` is this worker's running assignment while the block runs."""
        with self._lock:
            self.running = sup
        try:
            yield
        finally:
            with self._lock:
                self.running = None
                self._set_aside_before += sup.recorder.set_aside.count

    def set_aside_total(self) -> int:
        with self._lock:
            running, before = self.running, self._set_aside_before
        return before + (running.recorder.set_aside.count if running is not None else 0)


class _Live(Collector):
    """What is read at scrape time."""

    def __init__(self, m: WorkerMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        m = self.m
        yield InfoMetricFamily(P[:-1], "this worker's id and device", value=m.identity)
        state = m.state_of()
        g = GaugeMetricFamily(P + "state", "1 for the worker's current state", labels=["state"])
        for s in STATES:
            g.add_metric([s], float(s == state))
        yield g
        sup = m.running
        job = GaugeMetricFamily(
            P + "current_job",
            "1, labelled with the running job's id (empty: none)",
            labels=["job_id"],
        )
        job.add_metric([sup.c.job_id if sup is not None else ""], 1)
        yield job
        yield CounterMetricFamily(
            P + "events_set_aside",
            "event lines (or refused points) of trainers not taken into the store",
            value=m.set_aside_total(),
        )
        yield from _lag(sup)
        yield from _uploads(sup)


def _lag(sup: Supervised | None) -> Iterator[GaugeMetricFamily]:
    """The ingest lag: events read from the trainer's events file and not yet committed to
    the store, how long ago the trainer wrote the oldest of them (by the `time` it wrote),
    and the bytes of the file not read yet (they wait there while a checkpoint goes up)."""
    events = seconds = unread = 0.0
    if sup is not None:
        try:
            events, seconds, unread = _lag_of(sup)
        except Exception as e:  # a scrape must answer whatever the supervision is doing
            log.warning("metrics: ingest lag not read (%s)", e)
    yield GaugeMetricFamily(
        P + "ingest_lag_events", "trainer events read, not yet in the store", value=events
    )
    yield GaugeMetricFamily(
        P + "ingest_lag_seconds",
        "seconds since the trainer wrote the oldest event not yet in the store",
        value=seconds,
    )
    yield GaugeMetricFamily(
        P + "ingest_unread_bytes", "bytes of the trainer's events file not read yet", value=unread
    )


def _lag_of(sup: Supervised) -> tuple[float, float, float]:
    rec = sup.recorder
    times = [float(m.get("time") or 0) for m in list(rec.metrics)]
    times += [float(c.time) for c in list(rec.checkpoints) if c.time is not None]
    times = [t for t in times if t > 0]  # 0: a metric written without a time
    seconds = max(0.0, time.time() - min(times)) if times else 0.0
    unread = 0
    tail: EventTail | None = getattr(sup, "tail", None)  # made at the launch; rank 0 reads it
    if tail is not None and sup.c.rank == 0:
        unread = max(0, EventTail.size_of(sup.events_path) - tail.offset)
    return float(rec.pending), seconds, float(unread)


def _uploads(sup: Supervised | None) -> Iterator[GaugeMetricFamily]:
    """With an object store: checkpoints not yet durable there, log bytes not yet shipped."""
    files = unshipped = 0
    if sup is not None:
        uploads, shipper = sup.uploads, sup.shipper
        try:
            files = uploads.pending() if uploads is not None else 0
            unshipped = shipper.unshipped_bytes() if shipper is not None else 0
        except Exception as e:  # the shipper closed under us, a dict changed while copied
            log.debug("metrics: uploads not read (%s)", e)
    yield GaugeMetricFamily(
        P + "upload_queue",
        "checkpoint and weights files waiting to be durable in the object store",
        value=files,
    )
    yield GaugeMetricFamily(
        P + "log_unshipped_bytes",
        "bytes of the job log not yet in the object store",
        value=unshipped,
    )


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
