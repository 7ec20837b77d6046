"""Jobs as the API sees them: submit (idempotent), list (newest first, keyset cursor),
look up what a user may see, and record a cancel request.

The API writes only the intent columns (spec, name, owner, priority, cancel_requested);
every state change goes through `store.states.transition`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, and_, literal_column, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from torchyard.store.models import Assignment, Attempt, IdempotencyKey, Job, JobEvent, User, utcnow
from torchyard.store.states import (
    CANCELLED,
    CANCELLING,
    QUEUED,
    RUNNING,
    STARTING,
    IllegalTransition,
    transition,
)

MAX_PAGE = 500


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different spec (the API answers 409)."""

    def __init__(self, key: str, job_id: str):
        self.key, self.job_id = key, job_id
        super().__init__(
            f"Idempotency-Key {key!r} was already used for job {job_id} with a different spec"
        )


class BadCursor(ValueError):
    """A list cursor that this server did not hand out."""


@dataclass(frozen=True)
class Viewer:
    """Who is asking: a user id and whether they may see every job."""

    user_id: int
    is_admin: bool = False


def spec_hash(spec: dict[str, Any]) -> str:
    """Hash of a normalised spec: equal specs give equal hashes whatever their key order."""
    canon = json.dumps(spec, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def _replay(session: Session, user_id: int, key: str, request_hash: str) -> Job | None:
    row = session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.user_id == user_id, IdempotencyKey.key == key)
    )
    if row is None:
        return None
    if row.request_hash != request_hash:
        raise IdempotencyConflict(key, row.job_id)
    job = session.get(Job, row.job_id)
    if job is None:  # cannot happen with the FK cascade, but never answer with nothing
        raise IdempotencyConflict(key, row.job_id)
    return job


def create_job(
    session: Session,
    owner_id: int,
    spec: dict[str, Any],
    *,
    name: str,
    idempotency_key: str | None = None,
) -> tuple[Job, bool]:
    """Store a queued job for a normalised spec. Returns (job, created).

    With an idempotency key already used by this user: the original job and
    created=False when the spec is the same, IdempotencyConflict when it is not.
    """
    request_hash = spec_hash(spec)
    if idempotency_key is not None:
        job = _replay(session, owner_id, idempotency_key, request_hash)
        if job is not None:
            return job, False
    now = utcnow()
    job = Job(
        owner_id=owner_id,
        name=name,
        spec=spec,
        world_size=int(spec.get("world_size", 1)),
        priority=int(spec.get("priority", 0)),
        max_restarts=int(spec.get("max_restarts", 2)),
        state=QUEUED,
        attempt=1,
        cancel_requested=False,
        created_at=now,
        updated_at=now,
    )
    try:
        # A savepoint, so that losing a race on the same key leaves the session usable.
        with session.begin_nested():
            session.add(job)
            session.flush()
            session.add(
                JobEvent(
                    job_id=job.id,
                    type="state",
                    data={"from": None, "to": QUEUED, "reason": "submitted", "attempt": 1},
                    created_at=now,
                )
            )
            if idempotency_key is not None:
                session.add(
                    IdempotencyKey(
                        user_id=owner_id,
                        key=idempotency_key,
                        request_hash=request_hash,
                        job_id=job.id,
                        created_at=now,
                    )
                )
            session.flush()
    except IntegrityError:
        if idempotency_key is None:
            raise
        replay = _replay(session, owner_id, idempotency_key, request_hash)
        if replay is None:
            raise
        return replay, False
    return job, True


def get_job(session: Session, viewer: Viewer, job_id: str) -> tuple[Job, str] | None:
    """The job and its owner's name, or None when it does not exist or the viewer may
    not see it (the API answers 404 either way, so ids of others' jobs leak nothing)."""
    if len(job_id) > 64:
        return None
    stmt = select(Job, User.name).join(User, User.id == Job.owner_id).where(Job.id == job_id)
    if not viewer.is_admin:
        stmt = stmt.where(Job.owner_id == viewer.user_id)
    row = session.execute(stmt).first()
    return (row[0], row[1]) if row is not None else None


def encode_cursor(created_at: datetime, job_id: str) -> str:
    raw = f"{created_at.isoformat()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        ts, job_id = raw.split("|", 1)
        created = datetime.fromisoformat(ts)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadCursor("not a cursor from this server") from e
    if created.tzinfo is None or not job_id:
        raise BadCursor("not a cursor from this server")
    return created, job_id


def list_jobs(
    session: Session,
    viewer: Viewer,
    *,
    states: Sequence[str] = (),
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[tuple[Job, str]], str | None]:
    """A page of (job, owner name), newest first, and the cursor of the next page (or None)."""
    limit = max(1, min(limit, MAX_PAGE))
    stmt = select(Job, User.name).join(User, User.id == Job.owner_id)
    if not viewer.is_admin:
        stmt = stmt.where(Job.owner_id == viewer.user_id)
    if states:
        stmt = stmt.where(Job.state.in_(list(states)))
    if cursor:
        created, job_id = decode_cursor(cursor)
        stmt = stmt.where(
            or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id))
        )
    rows = session.execute(
        stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    ).all()
    page = [(r[0], r[1]) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        last = page[-1][0]
        next_cursor = encode_cursor(last.created_at, last.id)
    return page, next_cursor


def attempts_of(session: Session, job_id: str) -> list[tuple[Attempt, list[Assignment]]]:
    """Every attempt of a job, oldest first, each with its rank assignments."""
    rows = session.execute(
        select(Attempt, Assignment)
        .outerjoin(Assignment, Assignment.attempt_id == Attempt.id)
        .where(Attempt.job_id == job_id)
        .order_by(Attempt.number, Assignment.rank)
    ).all()
    out: dict[int, tuple[Attempt, list[Assignment]]] = {}
    for attempt, assignment in rows:
        entry = out.setdefault(attempt.id, (attempt, []))
        if assignment is not None:
            entry[1].append(assignment)
    return list(out.values())


def request_cancel(session: Session, job: Job) -> Job:
    """Record a cancel: queued→cancelled at once, starting/running→cancelling (the worker
    then stops the trainer). Idempotent for a job already cancelling or cancelled;
    IllegalTransition for a job that already succeeded or failed."""
    for _ in range(5):
        if job.state in (CANCELLING, CANCELLED):
            return job
        target = CANCELLED if job.state == QUEUED else CANCELLING
        try:
            return transition(
                session, job, target, reason="cancel requested", cancel_requested=True
            )
        except IllegalTransition:
            if job.state not in (QUEUED, STARTING, RUNNING, CANCELLING, CANCELLED):
                raise  # succeeded or failed: nothing left to cancel
            # Lost a race with the scheduler or a worker; transition() refreshed the job.
    raise IllegalTransition(job.id, job.state, CANCELLING, "job kept changing state; retry")


# --- one-statement job view (the hot read path) --------------------------------------------

# Attempts (with their workers) and the newest point of each metric, aggregated to JSON in
# the same statement as the job row: one round trip and one snapshot. `{agg}`, `{obj}` and
# `{objagg}` are the dialect's JSON functions.
_ATTEMPTS_JSON = """(
SELECT {agg}({obj}(
    'number', a.number, 'state', a.state, 'rank0_endpoint', a.rank0_endpoint,
    'exit_code', a.exit_code, 'reason', a.reason, 'created_at', a.created_at,
    'started_at', a.started_at, 'ended_at', a.ended_at,
    'workers', {sub}((SELECT {agg}({obj}('rank', s.rank, 'worker_id', s.worker_id))
                      FROM assignments s WHERE s.attempt_id = a.id))))
FROM attempts a WHERE a.job_id = jobs.id)"""

_LATEST_JSON = """(
WITH RECURSIVE names(name) AS (
    SELECT MIN(name) FROM metrics WHERE job_id = jobs.id
    UNION ALL
    SELECT (SELECT MIN(m.name) FROM metrics m WHERE m.job_id = jobs.id AND m.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
SELECT {objagg}(n.name, {obj}('step', m.step, 'value',
    -- non-finite values have no JSON spelling: null (PostgreSQL sorts NaN above all)
    CASE WHEN m.value > 1e308 OR m.value < -1e308 THEN NULL ELSE m.value END))
FROM names n
JOIN metrics m ON m.job_id = jobs.id AND m.name = n.name
    AND m.step = (SELECT MAX(x.step) FROM metrics x WHERE x.job_id = jobs.id AND x.name = n.name))"""

_JSON_FUNCS = {
    "postgresql": {
        "agg": "json_agg",
        "obj": "json_build_object",
        "objagg": "json_object_agg",
        "sub": "",
    },
    # json(): a subquery's JSON text nests as JSON, not as a string
    "sqlite": {
        "agg": "json_group_array",
        "obj": "json_object",
        "objagg": "json_group_object",
        "sub": "json",
    },
}


def _parse_time(value: Any) -> datetime | None:
    """Timestamps inside JSON come back as text (SQLite's without a zone: UTC)."""
    if value is None or isinstance(value, datetime):
        return value
    t = datetime.fromisoformat(str(value))
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def job_snapshot(session: Session, viewer: Viewer, job_id: str) -> dict[str, Any] | None:
    """Everything GET /v1/jobs/{id} shows, in one statement: the job's columns, `owner`,
    `attempts` (oldest first, each with `workers` by rank) and `latest_metrics`
    (`{name: {step, value}}`). None when missing or not visible to the viewer."""
    if len(job_id) > 64:
        return None
    funcs = _JSON_FUNCS[
        "postgresql" if session.get_bind().dialect.name == "postgresql" else "sqlite"
    ]
    stmt = (
        select(
            Job.__table__,
            User.name.label("owner"),
            literal_column(_ATTEMPTS_JSON.format(**funcs), JSON).label("attempts"),
            literal_column(_LATEST_JSON.format(**funcs), JSON).label("latest_metrics"),
        )
        .join(User, User.id == Job.owner_id)
        .where(Job.id == job_id)
    )
    if not viewer.is_admin:
        stmt = stmt.where(Job.owner_id == viewer.user_id)
    row = session.execute(stmt).mappings().first()
    if row is None:
        return None
    out = dict(row)
    attempts = sorted(out["attempts"] or [], key=lambda a: a["number"])
    for a in attempts:
        a["workers"] = sorted(a["workers"] or [], key=lambda w: w["rank"])
        for k in ("created_at", "started_at", "ended_at"):
            a[k] = _parse_time(a[k])
    out["attempts"] = attempts
    out["latest_metrics"] = out["latest_metrics"] or {}
    return out
