"""Sweeps and their trials (store/models.py: Sweep, SweepTrial).

- for the API: create, look up what a user may see, list (newest first, keyset cursor), the
  view GET shows (trials with their jobs' states, the best trial), cancel;
- for the controller (scheduler/sweeps.py): the sweeps it has work for, a sweep locked for
  one pass, its trials with their jobs, new points of the objective, a trial's and a sweep's
  end;
- where Optuna keeps the studies (`optuna_url`, `optuna_storage`): the same PostgreSQL
  database in its own schema, or a SQLite file beside torchyard's, never torchyard's own
  tables (Optuna's alembic_version would collide with ours).
"""

from __future__ import annotations

import math
import sqlite3
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, make_url, or_, select, text
from sqlalchemy.orm import Session, object_session

from torchyard.store.db import PG_CONNECT_ARGS, get_engine
from torchyard.store.dialect import is_postgres
from torchyard.store.jobs import MAX_PAGE, Viewer, decode_cursor, encode_cursor, request_cancel
from torchyard.store.metrics import query_series
from torchyard.store.models import (
    TRIAL_CANCELLED,
    TRIAL_COMPLETE,
    TRIAL_FAILED,
    TRIAL_PRUNED,
    Job,
    Sweep,
    SweepTrial,
    User,
    utcnow,
)
from torchyard.store.projects import ensure_personal, project_names, visible_projects
from torchyard.store.states import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, TERMINAL
from torchyard.store.webhooks import enqueue_sweep_event

if TYPE_CHECKING:
    from optuna.storages import RDBStorage

SWEEP_STATES = (RUNNING, SUCCEEDED, FAILED, CANCELLED)
# A trial's outcome, once decided (None while it runs): what Optuna is told (a cancelled
# trial is told FAIL: Optuna has no cancelled state).
COMPLETE, PRUNED, FAIL, CANCELLED_TRIAL = (
    TRIAL_COMPLETE,
    TRIAL_PRUNED,
    TRIAL_FAILED,
    TRIAL_CANCELLED,
)
PAUSED = "paused"  # a status, not an outcome: undecided, waiting at a rung (pruner halving)
OPTUNA_SCHEMA = "torchyard_optuna"


@dataclass(frozen=True)
class NewSweep:
    """A checked sweep to store (api/routers/sweeps.py checks it)."""

    name: str
    spec: dict[str, Any]
    space: dict[str, Any]
    metric: str
    mode: str
    max_trials: int
    parallel: int
    sampler: str
    pruner: str
    seed: int
    project_id: int | None = None  # None: the owner's personal project


def create_sweep(session: Session, owner_id: int, new: NewSweep) -> Sweep:
    now = utcnow()
    if new.project_id is None:
        owner = session.get(User, owner_id)
        if owner is None:
            raise LookupError(f"no user {owner_id}")
        new = replace(new, project_id=ensure_personal(session, owner).id)
    sweep = Sweep(owner_id=owner_id, **asdict(new), state=RUNNING, created_at=now, updated_at=now)
    session.add(sweep)
    session.flush()
    return sweep


def get_sweep(session: Session, viewer: Viewer, sweep_id: str) -> Sweep | None:
    """The sweep, or None when it does not exist or the viewer may not see it."""
    if len(sweep_id) > 64:
        return None
    stmt = select(Sweep).where(Sweep.id == sweep_id)
    if not viewer.is_admin:
        stmt = stmt.where(Sweep.project_id.in_(visible_projects(viewer.user_id)))
    return session.scalars(stmt).first()


def list_sweeps(
    session: Session,
    viewer: Viewer,
    *,
    states: list[str] | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[dict[str, Any]], str | None]:
    """A page of sweep summaries (`summary`), newest first, and the next page's cursor."""
    limit = max(1, min(limit, MAX_PAGE))
    stmt = select(Sweep)
    if not viewer.is_admin:
        stmt = stmt.where(Sweep.project_id.in_(visible_projects(viewer.user_id)))
    if states:
        stmt = stmt.where(Sweep.state.in_(states))
    if cursor:
        created, sweep_id = decode_cursor(cursor)
        stmt = stmt.where(
            or_(Sweep.created_at < created, and_(Sweep.created_at == created, Sweep.id < sweep_id))
        )
    rows = list(
        session.scalars(stmt.order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit + 1))
    )
    page = rows[:limit]
    trials = _trials_of(session, [s.id for s in page])
    owners = _owner_names(session, {s.owner_id for s in page})
    names = project_names(session, {s.project_id for s in page if s.project_id is not None})
    items = [
        summary(s, owners[s.owner_id], trials.get(s.id, []), names.get(s.project_id or 0))
        for s in page
    ]
    last = page[-1] if len(rows) > limit else None
    return items, encode_cursor(last.created_at, last.id) if last is not None else None


def sweep_view(session: Session, viewer: Viewer, sweep_id: str) -> dict[str, Any] | None:
    """Everything GET /v1/sweeps/{id} shows, or None when it is not the viewer's."""
    sweep = get_sweep(session, viewer, sweep_id)
    if sweep is None:
        return None
    trials = _trials_of(session, [sweep.id]).get(sweep.id, [])
    owner = _owner_names(session, {sweep.owner_id})[sweep.owner_id]
    ids = {sweep.project_id} if sweep.project_id is not None else set()
    project = project_names(session, ids).get(sweep.project_id or 0)
    return {
        **summary(sweep, owner, trials, project),
        "spec": sweep.spec,
        "space": sweep.space,
        "trials": trials,
    }


def summary(
    sweep: Sweep, owner: str, trials: list[dict[str, Any]], project: str | None = None
) -> dict[str, Any]:
    """A sweep's columns, its trials counted by status and its best trial (no trial list)."""
    counts = Counter(t["status"] for t in trials)
    return {
        "id": sweep.id,
        "name": sweep.name,
        "owner": owner,
        "project": project,
        "state": sweep.state,
        "objective": {"metric": sweep.metric, "mode": sweep.mode},
        "max_trials": sweep.max_trials,
        "parallel": sweep.parallel,
        "sampler": sweep.sampler,
        "pruner": sweep.pruner,
        "seed": sweep.seed,
        "error": sweep.error,
        "counts": {
            k: counts.get(k, 0) for k in (RUNNING, PAUSED, COMPLETE, PRUNED, FAIL, CANCELLED_TRIAL)
        },
        "best": best_trial(trials, sweep.mode),
        "created_at": sweep.created_at,
        "updated_at": sweep.updated_at,
        "finished_at": sweep.finished_at,
    }


def best_trial(trials: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The complete trial with the best value (the lowest number on a tie), or None."""
    done = [t for t in trials if t["status"] == COMPLETE and t["value"] is not None]
    if not done:
        return None
    sign = -1.0 if mode == "max" else 1.0
    best = min(done, key=lambda t: (sign * t["value"], t["number"]))
    return {k: best[k] for k in ("number", "job_id", "params", "value")}


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _trials_of(session: Session, sweep_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each sweep's trials, oldest first: `state` is its job's (failed when it has none),
    `status` running until an outcome is decided, then that outcome."""
    if not sweep_ids:
        return {}
    rows = session.execute(
        select(SweepTrial, Job.state)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id.in_(sweep_ids))
        .order_by(SweepTrial.sweep_id, SweepTrial.number)
    ).all()
    out: dict[str, list[dict[str, Any]]] = {}
    for t, job_state in rows:
        paused = t.outcome is None and t.paused_rung is not None and job_state == QUEUED
        out.setdefault(t.sweep_id, []).append(
            {
                "number": t.number,
                "job_id": t.job_id,
                "params": t.params,
                "state": job_state or FAILED,
                "status": t.outcome or (PAUSED if paused else RUNNING),
                "paused_at": t.paused_rung if paused else None,
                "value": _finite(t.value),
                "step": t.last_step,
                "pruned": t.outcome == PRUNED,
                "error": t.error,
            }
        )
    return out


def _owner_names(session: Session, ids: set[int]) -> dict[int, str]:
    if not ids:
        return {}
    rows = session.execute(select(User.id, User.name).where(User.id.in_(ids)))
    return {uid: name for uid, name in rows}


def lock_sweep(session: Session, sweep_id: str) -> Sweep | None:
    """The sweep, locked for this transaction (FOR UPDATE on PostgreSQL; SQLite's BEGIN
    IMMEDIATE serialises writers already): the API's cancel and every controller's pass
    over it take turns."""
    q = select(Sweep).where(Sweep.id == sweep_id).execution_options(populate_existing=True)
    if is_postgres(session):
        q = q.with_for_update()
    return session.scalars(q).first()


def cancel_sweep(session: Session, sweep: Sweep) -> bool:
    """Cancel a running sweep and every trial job of it still queued or running (through
    the jobs' own cancel). Idempotent: False when it had already ended."""
    locked = lock_sweep(session, sweep.id)
    if locked is None or locked.state != RUNNING:
        return False
    finish_sweep(locked, CANCELLED)
    jobs = session.scalars(
        select(Job).where(Job.sweep_id == sweep.id, Job.state.not_in(TERMINAL))
    ).all()
    for job in jobs:
        request_cancel(session, job, reason="sweep cancelled")
    return True


def finish_sweep(sweep: Sweep, state: str, error: str | None = None) -> None:
    """End the sweep (succeeded, failed or cancelled) and, in its session's transaction,
    write `sweep.completed` for its webhooks: every ending of a sweep fires it."""
    sweep.state, sweep.error = state, error
    sweep.finished_at = sweep.updated_at = utcnow()
    session = object_session(sweep)
    if session is not None:
        enqueue_sweep_event(session, sweep)


# --- the controller's reads and writes ----------------------------------------------------------


def active_sweep_ids(session: Session) -> list[str]:
    """Sweeps the controller has work for: running ones, and ended ones whose trials still
    wait for an outcome (a cancelled sweep's trials end after it)."""
    running = select(Sweep.id).where(Sweep.state == RUNNING)
    open_ = select(SweepTrial.sweep_id).where(SweepTrial.outcome.is_(None))
    return sorted(set(session.scalars(running)) | set(session.scalars(open_)))


def trials_with_jobs(session: Session, sweep_id: str) -> list[tuple[SweepTrial, Job | None]]:
    rows = session.execute(
        select(SweepTrial, Job)
        .outerjoin(Job, Job.id == SweepTrial.job_id)
        .where(SweepTrial.sweep_id == sweep_id)
        .order_by(SweepTrial.number)
    ).all()
    return [(t, j) for t, j in rows]


def add_trial(
    session: Session,
    sweep: Sweep,
    number: int,
    params: dict[str, Any],
    job_id: str | None,
    *,
    error: str | None = None,
) -> SweepTrial:
    """A trial row; one without a job (its values made an invalid spec) fails at once."""
    trial = SweepTrial(
        sweep_id=sweep.id, number=number, job_id=job_id, params=params, created_at=utcnow()
    )
    if job_id is None:
        end_trial(trial, FAIL, error=error)
    session.add(trial)
    session.flush()
    return trial


def end_trial(
    trial: SweepTrial, outcome: str, *, value: float | None = None, error: str | None = None
) -> None:
    trial.outcome, trial.error, trial.finished_at = outcome, error, utcnow()
    if value is not None:
        trial.value = value


def new_points(
    session: Session, job_id: str, metric: str, after_step: int | None
) -> list[tuple[int, float]]:
    """The objective's points of a job after `after_step` (all when None), by step."""
    series = query_series(session, job_id, names=[metric], after_step=after_step)[metric]
    return list(zip(series["steps"], series["values"], strict=True))


# --- Optuna's storage ------------------------------------------------------------------------------


def optuna_url(db_url: str) -> str:
    """Where Optuna keeps the studies. PostgreSQL: the same database, schema
    `torchyard_optuna`, named in the URL's search_path (Optuna's own migrations build their
    engine from the URL alone, so they land there too). SQLite: the file beside the
    database (`torchyard.db` -> `torchyard.optuna.db`), so Optuna's writes never wait for
    torchyard's write lock, which the controller holds while it asks Optuna for a trial."""
    url = make_url(db_url)
    if url.get_backend_name() == "postgresql":
        given = url.query.get("options")  # a repeated query key is a tuple
        given = " ".join(given) if isinstance(given, tuple) else given
        options = " ".join(filter(None, [given, f"-csearch_path={OPTUNA_SCHEMA}"]))
        return url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    path = url.database
    if not path or path == ":memory:":
        return "sqlite:///:memory:"
    p = Path(path)
    return url.set(database=str(p.with_name(f"{p.stem}.optuna{p.suffix}"))).render_as_string(
        hide_password=False
    )


def _engine_kwargs(db_url: str) -> dict[str, Any]:
    """A small pool: one connection does the controller's work (a second for overlap), and
    PostgreSQL links that die fail in seconds as torchyard's own do."""
    if db_url.startswith("postgresql"):
        return {"pool_size": 1, "max_overflow": 2, "pool_pre_ping": True,
                "connect_args": dict(PG_CONNECT_ARGS)}  # fmt: skip
    if optuna_url(db_url).endswith(":memory:"):
        return {}
    return {"pool_size": 1, "max_overflow": 2, "connect_args": {"timeout": 30}}


def optuna_storage(db_url: str) -> RDBStorage:
    """Optuna's RDB storage for torchyard's database `db_url`, its schema (PostgreSQL) or
    file (SQLite, in WAL mode as torchyard's) made first; its tables are made by Optuna here,
    and migrated when a newer Optuna needs it."""
    import optuna

    url = optuna_url(db_url)
    if db_url.startswith("postgresql"):
        with get_engine(db_url).begin() as conn:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{OPTUNA_SCHEMA}"'))
    elif not url.endswith(":memory:"):
        path = make_url(url).database
        assert path is not None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(path, timeout=30) as lite:  # WAL is kept by the file
            lite.execute("PRAGMA journal_mode=WAL")
        lite.close()
    storage = optuna.storages.RDBStorage(
        url, engine_kwargs=_engine_kwargs(db_url), skip_compatibility_check=True
    )
    if storage.get_current_version() != storage.get_head_version():
        storage.upgrade()
    return storage
