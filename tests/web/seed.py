"""Test data written straight into a store, for the dashboard's browser tests and its
benchmark: a job with a long curve (a million points in seconds, not a training run), and
many jobs at once."""

from __future__ import annotations

import math
import random
from datetime import timedelta
from typing import Any

from specs import digits_spec
from sqlalchemy import insert
from sqlalchemy.orm import Session

from torchyard.store.jobs import create_job
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job, User, utcnow
from torchyard.store.states import transition

SPEC: dict[str, Any] = digits_spec(epochs=3)
BATCH = 50_000


def loss_curve(n: int, spike_at: int, height: float = 100.0, seed: int = 0) -> list[float]:
    """A noisy decaying loss with one spike `height` times the curve there."""
    rng = random.Random(seed)
    vals = [2.0 * math.exp(-k / (n / 4)) + 0.05 + 0.01 * rng.random() for k in range(n)]
    vals[spike_at] *= height
    return vals


def finished_job(
    session: Session, user_id: int, name: str, spec: dict[str, Any] | None = None
) -> str:
    job, _ = create_job(session, user_id, {**(spec or SPEC), "name": name}, name=name)
    for to in ("starting", "running", "succeeded"):
        transition(session, job, to, reason="seeded")
    return job.id


def long_curve_job(
    session: Session, user_id: int, name: str, n: int, spike_at: int, height: float = 100.0
) -> str:
    """A succeeded job whose `train/loss` has `n` points (steps 0..n-1) with one spike,
    and a `val/loss` every n/100 steps, written through the store's own ingest."""
    job_id = finished_job(session, user_id, name)
    vals = loss_curve(n, spike_at, height)
    for lo in range(0, n, BATCH):
        rows = [{"name": "train/loss", "step": k, "epoch": None, "value": vals[k], "time": 0.0}
                for k in range(lo, min(n, lo + BATCH))]  # fmt: skip
        ingest_metrics(session, job_id, rows)
    val_every = max(1, n // 100)
    ingest_metrics(session, job_id, [
        {"name": "val/loss", "step": k, "epoch": None, "value": vals[k] * 1.1, "time": 0.0}
        for k in range(0, n, val_every) if k != spike_at
    ])  # fmt: skip
    return job_id


def many_jobs(session: Session, user_id: int, count: int, prefix: str = "bulk") -> None:
    """`count` succeeded jobs in one bulk insert (a table's worth of history)."""
    now = utcnow()
    rows = [
        {"id": f"{i:08x}{'b' * 24}", "owner_id": user_id, "name": f"{prefix}-{i}",
         "spec": {**SPEC, "name": f"{prefix}-{i}"}, "world_size": 1, "priority": 0,
         "preemptible": True, "max_restarts": 2, "state": "succeeded", "attempt": 1,
         "cancel_requested": False, "created_at": now - timedelta(seconds=count - i),
         "updated_at": now, "finished_at": now,
         "progress": {"step": 100, "total_steps": 100, "epoch": 3.0}}
        for i in range(count)
    ]  # fmt: skip
    for lo in range(0, count, 2000):
        session.execute(insert(Job), rows[lo : lo + 2000])


def user_id(session: Session, name: str) -> int:
    from torchyard.store.auth import get_or_create_user

    uid = get_or_create_user(session, name).id
    assert isinstance(uid, int) and session.get(User, uid) is not None
    return uid
