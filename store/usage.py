"""Fair-share usage: the worker-seconds each user's (or each project's) attempts held,
decayed with a half-life.

An attempt of world size w that held its workers from `a` to `b` (now, while it runs)
contributes w * integral of 2^(-(now - t) / half_life) over [a, b], which is
w * (e^(-k(now - b)) - e^(-k(now - a))) / k with k = ln 2 / half_life. It is computed from
the attempts themselves, one aggregate statement, so nothing accumulates that a crash,
an outage or a second scheduler could count twice or lose. Attempts that ended more than
HORIZON_HALF_LIVES half-lives ago (under 0.1% of their weight) are not read.

One unit for every kind of worker: a GPU worker holds one GPU, a CPU worker one CPU slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Float, case, cast, func, literal, or_, select, type_coerce
from sqlalchemy.orm import InstrumentedAttribute, Session

from torchyard.store.dialect import is_postgres
from torchyard.store.models import Attempt, Job
from torchyard.store.states import ATTEMPT_ACTIVE

HORIZON_HALF_LIVES = 10


def _epoch(session: Session, col: ColumnElement[datetime]) -> ColumnElement[float]:
    """Seconds since the epoch of a timestamp column, in SQL."""
    if is_postgres(session):
        return type_coerce(func.extract("epoch", col), Float())  # same SQL, typed float
    # SQLite keeps UTC text; julianday counts days from noon, 4714 BC.
    return (func.julianday(col) - 2440587.5) * 86400.0


def usage_by_user(
    session: Session,
    now: datetime,
    half_life_s: float,
    user_ids: Iterable[int] | None = None,
) -> dict[int, float]:
    """Decayed worker-seconds per user id, of their jobs in every project (users with none
    are absent)."""
    return _usage_by(session, Job.owner_id, now, half_life_s, user_ids)


def usage_by_project(
    session: Session, now: datetime, half_life_s: float, project_ids: Iterable[int]
) -> dict[int, float]:
    """Decayed worker-seconds per project id, of its jobs whoever submitted them (projects
    with none are absent): the same one aggregate, grouped by project."""
    return _usage_by(session, Job.project_id, now, half_life_s, project_ids)


def _usage_by(
    session: Session,
    key: InstrumentedAttribute[Any],
    now: datetime,
    half_life_s: float,
    ids: Iterable[int] | None,
) -> dict[int, float]:
    k = math.log(2) / half_life_s
    t_now = now.timestamp()
    start = _epoch(session, func.coalesce(Attempt.started_at, Attempt.created_at))
    end = case(
        (Attempt.state.in_(ATTEMPT_ACTIVE), literal(t_now)),
        else_=_epoch(session, func.coalesce(Attempt.ended_at, Attempt.created_at)),
    )
    held = cast(Attempt.world_size, Float) * (
        func.exp(-k * (t_now - end)) - func.exp(-k * (t_now - start))
    )
    horizon = now - timedelta(seconds=half_life_s * HORIZON_HALF_LIVES)
    q = (
        select(key, func.sum(held) / k)
        .join(Job, Job.id == Attempt.job_id)
        .where(or_(Attempt.state.in_(ATTEMPT_ACTIVE), Attempt.ended_at >= horizon))
        .group_by(key)
    )
    if ids is not None:
        q = q.where(key.in_(list(ids)))
    return {int(kid): max(0.0, float(v or 0.0)) for kid, v in session.execute(q) if kid is not None}
