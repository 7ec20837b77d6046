"""Prometheus metrics of the worker (worker/metrics.py) and, end to end, of the real scheduler
and worker processes scraped over HTTP; `torchyard up`'s metrics ports. The scheduler's
metrics in-process: tests/scheduler/test_scheduler_metrics.py."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from promtext import Samples, labelled, parse, value
from sqlalchemy import select
from support.worker_cluster import Cluster, free_port, free_port_run, trainer_pid, wait_for
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.attempts import Claimed
from torchyard.store.db import session_scope
from torchyard.store.models import Attempt
from torchyard.up import Child, Up, UpError
from torchyard.worker.events import EventRecorder, EventTail
from torchyard.worker.identity import Device
from torchyard.worker.metrics import STATES, WorkerMetrics
from torchyard.worker.publish import CheckpointUploads, LogShipper
from torchyard.worker.supervisor import WorkerContext, run_assignment


def _scrape(m: WorkerMetrics) -> Samples:
    return parse(generate_latest(m.registry).decode())


@dataclass
class _Running:
    """What the metrics read of a supervision (worker/metrics.py Supervised)."""

    c: Claimed
    events_path: Path
    recorder: EventRecorder = field(default_factory=lambda: EventRecorder("j1", 1, 1))
    uploads: CheckpointUploads | None = None
    shipper: LogShipper | None = None
    tail: EventTail | None = None


def test_ingest_lag_set_aside_and_the_current_job(tmp_path: Path) -> None:
    m = WorkerMetrics()
    m.state_of = lambda: "busy"
    events = tmp_path / "events.jsonl"
    line = json.dumps({"type": "metric", "time": time.time() - 30, "step": 1,
                       "name": "train/loss", "value": 1.0})  # fmt: skip
    events.write_text(line + "\n")
    run = _Running(Claimed(1, 1, 1, "j1", 0, 1, {}, False), events)
    run.tail = EventTail(events)
    with m.supervising(run):
        run.recorder.add_all(run.tail)
        run.recorder.set_aside.add("a line too long")
        with events.open("a") as f:
            f.write('{"type": "progress"}\n')  # written, not read yet
        s = _scrape(m)
        assert labelled(s, "torchyard_worker_state", "state") == {
            st: float(st == "busy") for st in STATES
        }
        assert labelled(s, "torchyard_worker_current_job", "job_id") == {"j1": 1}
        assert value(s, "torchyard_worker_ingest_lag_events") == 2  # the point, the count
        assert 30 <= value(s, "torchyard_worker_ingest_lag_seconds") < 60
        assert value(s, "torchyard_worker_ingest_unread_bytes") == len('{"type": "progress"}\n')
        assert value(s, "torchyard_worker_events_set_aside_total") == 1
        run.recorder.clear()  # committed
        s = _scrape(m)
        assert value(s, "torchyard_worker_ingest_lag_events") == 0
        assert value(s, "torchyard_worker_ingest_lag_seconds") == 0
    s = _scrape(m)
    assert labelled(s, "torchyard_worker_current_job", "job_id") == {"": 1}
    assert value(s, "torchyard_worker_events_set_aside_total") == 1  # kept past the job
    m.trainer_started(1)
    m.trainer_started(2)  # attempt 2: the job's trainer started again
    s = _scrape(m)
    assert value(s, "torchyard_worker_trainer_starts_total") == 2
    assert value(s, "torchyard_worker_trainer_restarts_total") == 1


def test_a_handed_back_attempt_is_counted(db_url: str, tmp_path: Path) -> None:
    """Rank 1 of a gang on a stopping worker gives its attempt back before any launch."""
    settings = Settings(_env_file=None, database_url=db_url, home=tmp_path)  # type: ignore[call-arg]
    with session_scope(db_url) as s:
        make_worker(s, "w0")
        make_worker(s, "w1")
        make_job(s, world_size=2)
        rank1 = next(d for d in schedule(s, heartbeat_timeout_s=10) if d.rank == 1)
    ctx = WorkerContext(settings, rank1.worker_id, Device("cpu", None, "cpu", None), "127.0.0.1")
    ctx.stopping.set()
    assert run_assignment(ctx, rank1.assignment_id)
    with session_scope(db_url) as s:
        assert s.scalars(select(Attempt.state)).one() == "handed_back"
    m = _scrape(ctx.metrics)
    assert labelled(m, "torchyard_worker_attempts_ended_total", "outcome") == {
        "succeeded": 0, "failed": 0, "lost": 0, "handed_back": 1, "cancelled": 0,
    }  # fmt: skip
    assert value(m, "torchyard_worker_trainer_starts_total") == 0
    assert labelled(m, "torchyard_worker_current_job", "job_id") == {"": 1}


def test_up_gives_the_scheduler_the_base_port_and_worker_i_base_plus_1_plus_i(
    capsys: pytest.CaptureFixture[str],
) -> None:
    up = Up(argparse.Namespace())
    me = ["python", "-m", "torchyard"]
    up.children = [
        Child("api", [*me, "api"], Path("api.log")),
        Child("scheduler", [*me, "scheduler"], Path("s.log")),
        *(Child(f"worker-cpu{i}", [*me, "worker"], Path(f"w{i}.log")) for i in range(2)),
    ]
    base = free_port_run(3)
    up._metrics_ports(base, "127.0.0.1")
    ports = {c.name: c.argv[c.argv.index("--metrics-port") + 1] for c in up.children[1:]}
    assert ports == {"scheduler": str(base), "worker-cpu0": str(base + 1),
                     "worker-cpu1": str(base + 2)}  # fmt: skip
    assert "--metrics-port" not in up.children[0].argv  # the API serves its own /metrics
    assert f"scheduler {base}, workers {base + 1}-{base + 2}" in capsys.readouterr().out
    with pytest.raises(UpError, match="past 65535"):
        up._metrics_ports(65534, "127.0.0.1")


def _get(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return parse(r.read().decode())


def _idle(port: int) -> Samples | None:
    m = _get(port)
    return m if value(m, "torchyard_worker_state", state="idle") == 1 else None


# About 3.5 s of training on one CPU thread (~40k samples/s): still running when the test
# kills its trainer, a checkpoint each epoch to resume from.
JOB: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [256]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 16000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 5,
    "max_restarts": 2,
}


@pytest.mark.e2e
def test_the_scheduler_and_a_worker_serve_their_metrics(tmp_path: Path) -> None:
    """The real processes, scraped over HTTP while a job runs, is restarted (its trainer
    killed) and ends: the scheduler's setting gives its port, the worker's flag overrides
    the same setting."""
    sched_port, worker_port = free_port(), free_port()
    c = Cluster(tmp_path, extra_env={"TORCHYARD_METRICS_PORT": str(sched_port)})
    try:
        c.start(workers=0)
        c._spawn("w0", ["worker", "--device", "cpu", "--name", "w0",
                        "--metrics-port", str(worker_port)])  # fmt: skip
        c.wait_workers(1)
        w = wait_for(lambda: _get(worker_port), 30, "the worker's metrics")
        assert value(w, "torchyard_worker_state", state="idle") == 1
        assert value(w, "torchyard_worker_info", worker="w0", device="cpu", gpu="") == 1
        job = c.submit(JOB)["id"]
        c.wait_state(job, "running", timeout=60)
        busy = _get(worker_port)
        assert value(busy, "torchyard_worker_state", state="busy") == 1
        assert labelled(busy, "torchyard_worker_current_job", "job_id") == {job: 1}
        os.kill(trainer_pid(c, job), signal.SIGKILL)
        c.wait_state(job, "succeeded", timeout=90)
        w = wait_for(lambda: _idle(worker_port), 15, "the worker idle again")
        assert labelled(w, "torchyard_worker_current_job", "job_id") == {"": 1}
        assert value(w, "torchyard_worker_trainer_starts_total") == 2
        assert value(w, "torchyard_worker_trainer_restarts_total") == 1
        ended = labelled(w, "torchyard_worker_attempts_ended_total", "outcome")
        assert ended["lost"] == 1 and ended["succeeded"] == 1
        assert value(w, "torchyard_worker_ingest_lag_events") == 0
        s = _get(sched_port)
        assert value(s, "torchyard_scheduler_pass_duration_seconds_count") > 0
        assert value(s, "torchyard_scheduler_jobs_placed_per_pass_sum") == 2  # placed twice
        assert value(s, "torchyard_scheduler_dispatch_latency_seconds_count") == 2
        assert value(s, "torchyard_scheduler_store_up") == 1
        assert labelled(s, "torchyard_scheduler_queue_depth", "priority") == {}
        ages = labelled(s, "torchyard_scheduler_worker_heartbeat_age_seconds", "worker")
        assert set(ages) == {"w0"} and ages["w0"] < 5
    finally:
        c.stop()
