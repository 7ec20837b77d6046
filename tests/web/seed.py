"""Test data written straight into a store, for the dashboard's browser tests and its
benchmark: a job with a long curve (a million points in seconds, not a training run), and
many jobs at once."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic import TypeAdapter
from specs import digits_spec
from sqlalchemy import insert
from sqlalchemy.orm import Session

from torchyard.scheduler.space import Space, distributions, with_params
from torchyard.store.db import session_scope
from torchyard.store.jobs import create_job
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job, Sweep, SweepTrial, User, utcnow
from torchyard.store.projects import personal_project_id
from torchyard.store.states import transition
from torchyard.store.sweeps import optuna_storage

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
    project_id = personal_project_id(session, user_id)
    rows = [
        {"id": f"{i:08x}{'b' * 24}", "owner_id": user_id, "project_id": project_id,
         "name": f"{prefix}-{i}",
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


# --- sweeps ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedTrial:
    """A trial as the sweep controller leaves it: `outcome` None while it runs; `points`
    the objective's curve (step, value); `value` what the controller recorded (the last
    point reported: a complete trial's final value, a pruned one's at its rung)."""

    params: dict[str, Any]
    job_state: str
    outcome: str | None
    points: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None
    paused_rung: int | None = None  # pruner halving: paused there, its job queued and held

    @property
    def value(self) -> float | None:
        return self.points[-1][1] if self.points else None


_JOB_PATHS = {"queued": [], "running": ["starting", "running"], "succeeded": ["starting", "running", "succeeded"],
              "failed": ["starting", "running", "failed"], "cancelled": ["cancelled"]}  # fmt: skip


def sweep_trials(session: Session, sweep_id: str, trials: list[SeedTrial]) -> list[str]:
    """Each trial's job (the sweep's spec with its values, driven to `job_state`), its
    objective's points and its row, numbered 0, 1, …; their job ids."""
    sweep = session.get(Sweep, sweep_id)
    assert sweep is not None
    ids = []
    for number, t in enumerate(trials):
        name = f"{sweep.name}-{number}"
        spec = {**with_params(sweep.spec, t.params), "name": name}
        job, _ = create_job(session, sweep.owner_id, spec, name=name)
        job.sweep_id = sweep_id
        for to in _JOB_PATHS[t.job_state]:
            transition(session, job, to, reason="seeded")
        rows = [{"name": sweep.metric, "step": k, "value": v, "time": 0.0} for k, v in t.points]
        if rows:
            ingest_metrics(session, job.id, rows)
        session.add(SweepTrial(
            sweep_id=sweep_id, number=number, job_id=job.id, params=t.params, outcome=t.outcome,
            value=t.value, last_step=t.points[-1][0] if t.points else None, error=t.error,
            finished_at=utcnow() if t.outcome else None, paused_rung=t.paused_rung,
        ))  # fmt: skip
        ids.append(job.id)
    session.flush()
    return ids


def sweep_study(db_url: str, sweep_id: str, trials: list[SeedTrial]) -> None:
    """The sweep's Optuna study with the same trials (numbered alike), as the controller
    would have told it: what the importances are computed from."""
    import optuna
    from optuna.trial import TrialState, create_trial

    with session_scope(db_url) as s:
        sweep = s.get(Sweep, sweep_id)
        assert sweep is not None
        space, mode = TypeAdapter(Space).validate_python(sweep.space), sweep.mode
    storage = optuna_storage(db_url)
    study = optuna.create_study(study_name=sweep_id, storage=storage,
                                direction="maximize" if mode == "max" else "minimize")  # fmt: skip
    states = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL,
              None: TrialState.RUNNING}  # fmt: skip
    for t in trials:
        state = states[t.outcome]
        study.add_trial(create_trial(
            params=t.params, distributions=distributions(space), state=state,
            value=t.value if state == TrialState.COMPLETE else None,
            intermediate_values=dict(t.points) if state != TrialState.FAIL else None,
        ))  # fmt: skip
    storage.engine.dispose()
