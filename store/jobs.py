"""Jobs as the API sees them: submit (idempotent), list (newest first, keyset cursor),
look up what a user may see (the jobs of the projects they have a role in; admins: all), record a cancel request, the one-statement snapshot every
job body is built from, and the job's version (what a conditional GET reads).

The API writes only the intent columns (spec, name, owner, priority, cancel_requested);
every state change goes through `store.states.transition`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Exists,
    Select,
    and_,
    bindparam,
    exists,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from torchyard.store.dialect import is_postgres, json_member_text
from torchyard.store.models import (
    TRIAL_PRUNED,
    Attempt,
    IdempotencyKey,
    Job,
    JobEvent,
    JobTag,
    Project,
    SweepTrial,
    User,
    utcnow,
)
from torchyard.store.projects import ensure_personal, visible_projects, visible_projects_param
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
    """Who is asking: a user id and whether they may see every job (else: the jobs of the
    projects they have a role in, store/projects.py)."""

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


def idempotency_key_used(session: Session, user_id: int, key: str) -> bool:
    """Whether `create_job` with this key would answer from an earlier job (a replay or
    a conflict) rather than store a new one: such a retry is not refused by a quota."""
    q = select(IdempotencyKey.job_id).where(
        IdempotencyKey.user_id == user_id, IdempotencyKey.key == key
    )
    return session.scalar(q) is not None


@dataclass(frozen=True)
class Placement:
    """Where a new job goes and what it carries beside its spec: its project (None: the
    owner's personal project), tags and notes from the submit, the job it re-runs."""

    project_id: int | None = None
    tags: tuple[str, ...] = ()
    notes: str | None = None
    rerun_of: str | None = None


def _new_job(
    owner_id: int,
    spec: dict[str, Any],
    name: str,
    now: datetime,
    sweep_id: str | None,
    placed: Placement,
) -> Job:
    return Job(
        owner_id=owner_id,
        project_id=placed.project_id,
        tags=list(placed.tags),
        notes=placed.notes,
        rerun_of=placed.rerun_of,
        name=name,
        spec=spec,
        world_size=int(spec.get("world_size", 1)),
        priority=int(spec.get("priority", 0)),
        preemptible=bool(spec.get("preemptible", True)),
        max_restarts=int(spec.get("max_restarts", 2)),
        state=QUEUED,
        attempt=1,
        cancel_requested=False,
        created_at=now,
        updated_at=now,
        sweep_id=sweep_id,
    )


def _insert(session: Session, job: Job, key: str | None, request_hash: str) -> None:
    """The job, its `queued` event and its idempotency key, in a savepoint: losing a race
    on the same key (IntegrityError) leaves the session usable."""
    now = job.created_at
    with session.begin_nested():
        session.add(job)
        session.flush()
        session.add_all(JobTag(job_id=job.id, tag=t) for t in job.tags)
        session.add(
            JobEvent(
                job_id=job.id,
                type="state",
                data={"from": None, "to": QUEUED, "reason": "submitted", "attempt": 1},
                created_at=now,
            )
        )
        if key is not None:
            session.add(
                IdempotencyKey(
                    user_id=job.owner_id,
                    key=key,
                    request_hash=request_hash,
                    job_id=job.id,
                    created_at=now,
                )
            )
        session.flush()


def create_job(
    session: Session,
    owner_id: int,
    spec: dict[str, Any],
    *,
    name: str,
    idempotency_key: str | None = None,
    sweep_id: str | None = None,
    placed: Placement = Placement(),
) -> tuple[Job, bool]:
    """Store a queued job for a normalised spec. Returns (job, created).

    With an idempotency key already used by this user: the original job and
    created=False when the spec is the same, IdempotencyConflict when it is not.
    `sweep_id`: the sweep the job is a trial of; `placed`: its project, tags, notes.
    """
    if placed.project_id is None:
        owner = session.get(User, owner_id)
        if owner is None:
            raise LookupError(f"no user {owner_id}")
        placed = replace(placed, project_id=ensure_personal(session, owner).id)
    request_hash = spec_hash(spec)
    if idempotency_key is not None:
        job = _replay(session, owner_id, idempotency_key, request_hash)
        if job is not None:
            return job, False
    job = _new_job(owner_id, spec, name, utcnow(), sweep_id, placed)
    try:
        _insert(session, job, idempotency_key, request_hash)
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
        stmt = stmt.where(Job.project_id.in_(visible_projects(viewer.user_id)))
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


def param_texts(value: str) -> list[str]:
    """The JSON texts a stored `params` value equal to `value` (as a `?param=name:value`
    query gives it) may have: the string itself, and when it reads as a JSON number or
    boolean, that too (an integral number as int and as float: `3` and `3.0`). Compared
    with each job's stored text (store/dialect.py: `json_member_text`)."""
    texts = [json.dumps(value)]
    try:
        parsed = json.loads(value)
    except ValueError:
        return texts
    if isinstance(parsed, str | bool) or (
        isinstance(parsed, int | float) and math.isfinite(parsed)
    ):
        texts.append(json.dumps(parsed))
    if isinstance(parsed, int) and not isinstance(parsed, bool) and abs(parsed) < 2**53:
        texts.append(json.dumps(float(parsed)))
    elif isinstance(parsed, float) and parsed.is_integer():
        texts.append(json.dumps(int(parsed)))
    return list(dict.fromkeys(texts))


@dataclass(frozen=True)
class JobFilter:
    """What a job list narrows to: states, one project, one tag, parameters (each name with
    the JSON texts its value may have: `param_texts`; all must match); archived jobs are
    left out unless `archived` is True (only them) or None (both)."""

    states: Sequence[str] = ()
    project_id: int | None = None
    tag: str | None = None
    archived: bool | None = False
    params: Sequence[tuple[str, Sequence[str]]] = ()

    def where(self) -> list[Any]:
        where: list[Any] = []
        if self.states:
            where.append(Job.state.in_(list(self.states)))
        if self.project_id is not None:
            where.append(Job.project_id == self.project_id)
        if self.tag is not None:
            where.append(Job.id.in_(select(JobTag.job_id).where(JobTag.tag == self.tag)))
        for name, texts in self.params:
            where.append(json_member_text(Job.spec, "params", name).in_(list(texts)))
        if self.archived is not None:
            where.append(
                Job.archived_at.is_not(None) if self.archived else Job.archived_at.is_(None)
            )
        return where


def list_jobs(
    session: Session,
    viewer: Viewer,
    *,
    states: Sequence[str] = (),
    cursor: str | None = None,
    limit: int = 50,
    only: JobFilter | None = None,
) -> tuple[list[tuple[Job, str, str | None]], str | None]:
    """A page of (job, owner name, project name), newest first, and the cursor of the next
    page (or None). `only`: the filters (default: not archived, `states`)."""
    limit = max(1, min(limit, MAX_PAGE))
    only = only or JobFilter(states=states)
    stmt = (
        select(Job, User.name, Project.name)
        .join(User, User.id == Job.owner_id)
        .outerjoin(Project, Project.id == Job.project_id)
        .where(*only.where())
    )
    if not viewer.is_admin:
        stmt = stmt.where(Job.project_id.in_(visible_projects(viewer.user_id)))
    if cursor:
        created, job_id = decode_cursor(cursor)
        stmt = stmt.where(
            or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id))
        )
    rows = session.execute(
        stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    ).all()
    page: list[tuple[Job, str, str | None]] = [(r[0], r[1], r[2]) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        last = page[-1][0]
        next_cursor = encode_cursor(last.created_at, last.id)
    return page, next_cursor


_PRUNED_STATES = (CANCELLING, CANCELLED)


def pruned_trial() -> Exists:
    """The job (correlated: `Job.id`) is a sweep trial its pruner stopped at a rung, and that
    cancel is what is ending it (cancelling or cancelled: a trainer that finished first
    makes it succeeded). Lists and pages say `pruned`; no `job.cancelled` webhook fires for
    it (store/webhooks.py: the sweep's own event covers its trials)."""
    # Our constants inline, not bound parameters: the statement is also compiled once and
    # run with the viewer's parameters alone (store/asyncreads.py).
    pruned: ColumnElement[str] = literal_column(f"'{TRIAL_PRUNED}'")
    ending: list[ColumnElement[str]] = [literal_column(f"'{state}'") for state in _PRUNED_STATES]
    return exists().where(
        SweepTrial.job_id == Job.id, SweepTrial.outcome == pruned, Job.state.in_(ending)
    )


def pruned_jobs(session: Session, job_ids: Sequence[str]) -> set[str]:
    """Which of `job_ids` are pruned trials, as `pruned_trial` says (a page of a list: one
    query)."""
    if not job_ids:
        return set()
    rows = session.scalars(select(Job.id).where(Job.id.in_(list(job_ids)), pruned_trial()))
    return set(rows)


def request_cancel(session: Session, job: Job, *, reason: str = "cancel requested") -> Job:
    """Record a cancel: queued→cancelled at once, starting/running→cancelling (the worker
    then stops the trainer). Idempotent for a job already cancelling or cancelled;
    IllegalTransition for a job that already succeeded or failed. `reason` goes into the
    state event (a sweep's pruner says `pruned`)."""
    for _ in range(5):
        if job.state in (CANCELLING, CANCELLED):
            return job
        target = CANCELLED if job.state == QUEUED else CANCELLING
        try:
            return transition(session, job, target, reason=reason, cancel_requested=True)
        except IllegalTransition:
            if job.state not in (QUEUED, STARTING, RUNNING, CANCELLING, CANCELLED):
                raise  # succeeded or failed: nothing left to cancel
            # Lost a race with the scheduler or a worker; transition() refreshed the job.
    raise IllegalTransition(job.id, job.state, CANCELLING, "job kept changing state; retry")


# --- one-statement job view (the hot read path) --------------------------------------------

# Attempts (with their workers) and the newest point of each metric, aggregated to JSON in
# the same statement as the job row: one round trip and one snapshot. `{agg}`, `{obj}` and
# `{sub}` are the dialect's JSON functions.
_ATTEMPTS_JSON = """(
SELECT {agg}({obj}(
    'number', a.number, 'state', a.state, 'rank0_endpoint', a.rank0_endpoint,
    'exit_code', a.exit_code, 'reason', a.reason, 'created_at', a.created_at,
    'started_at', a.started_at, 'ended_at', a.ended_at,
    'workers', {sub}((SELECT {agg}({obj}('rank', s.rank, 'worker_id', s.worker_id))
                      FROM assignments s WHERE s.attempt_id = a.id))))
FROM attempts a WHERE a.job_id = jobs.id)"""

# The newest point of each metric, in one index probe per name on
# uq_metrics_job_name_step: walk the names downwards, each probe landing on the next name's
# last step (PostgreSQL; SQLite has no LATERAL, so it finds each name, then its last
# step). Non-finite values have no JSON spelling: null
# (PostgreSQL sorts NaN above every number).
_LATEST_JSON = {
    "postgresql": """(
WITH RECURSIVE latest AS (
    (SELECT m.name, m.step, m.value FROM metrics m WHERE m.job_id = jobs.id
     ORDER BY m.name DESC, m.step DESC LIMIT 1)
    UNION ALL
    SELECT nx.name, nx.step, nx.value FROM latest l, LATERAL (
        SELECT m.name, m.step, m.value FROM metrics m
        WHERE m.job_id = jobs.id AND m.name < l.name
        ORDER BY m.name DESC, m.step DESC LIMIT 1) nx
)
SELECT json_object_agg(name, json_build_object('step', step, 'value',
    CASE WHEN value > 1e308 OR value < -1e308 THEN NULL ELSE value END) ORDER BY name)
FROM latest)""",
    "sqlite": """(
WITH RECURSIVE names(name) AS (
    SELECT MIN(name) FROM metrics WHERE job_id = jobs.id
    UNION ALL
    SELECT (SELECT MIN(m.name) FROM metrics m WHERE m.job_id = jobs.id AND m.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
SELECT json_group_object(n.name, json_object('step', m.step, 'value',
    CASE WHEN m.value > 1e308 OR m.value < -1e308 THEN NULL ELSE m.value END))
FROM names n
JOIN metrics m ON m.job_id = jobs.id AND m.name = n.name
    AND m.step = (SELECT MAX(x.step) FROM metrics x WHERE x.job_id = jobs.id AND x.name = n.name))""",
}

_JSON_FUNCS = {
    "postgresql": {
        "agg": "json_agg",
        "obj": "json_build_object",
        "sub": "",
    },
    # json(): a subquery's JSON text nests as JSON, not as a string
    "sqlite": {
        "agg": "json_group_array",
        "obj": "json_object",
        "sub": "json",
    },
}


def _parse_time(value: Any) -> datetime | None:
    """Timestamps inside JSON come back as text (SQLite's without a zone: UTC)."""
    if value is None or isinstance(value, datetime):
        return value
    t = datetime.fromisoformat(str(value))
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


@functools.cache
def snapshot_stmt(dialect: str, admin: bool) -> Select[Any]:
    """The statement of job_snapshot, built once per dialect and viewer kind (building it
    per request cost more than running it)."""
    dialect = "postgresql" if dialect == "postgresql" else "sqlite"
    funcs = _JSON_FUNCS[dialect]
    stmt = (
        select(
            Job.__table__,
            User.name.label("owner"),
            Project.name.label("project"),
            literal_column(_ATTEMPTS_JSON.format(**funcs), JSON).label("attempts"),
            literal_column(_LATEST_JSON[dialect], JSON).label("latest_metrics"),
            pruned_trial().label("pruned"),
        )
        .join(User, User.id == Job.owner_id)
        .outerjoin(Project, Project.id == Job.project_id)
        .where(Job.id == bindparam("job_id"))
    )
    return stmt if admin else stmt.where(Job.project_id.in_(visible_projects_param()))


def viewer_params(viewer: Viewer, job_id: str) -> dict[str, Any]:
    return {"job_id": job_id} if viewer.is_admin else {"job_id": job_id, "user_id": viewer.user_id}


def _connection(db: Session | Connection) -> Connection:
    # A bare connection spares the hot read path a Session's set-up and tear-down.
    return db.connection() if isinstance(db, Session) else db


def job_snapshot(db: Session | Connection, viewer: Viewer, job_id: str) -> dict[str, Any] | None:
    """Everything GET /v1/jobs/{id} shows, in one statement: the job's columns (`version`
    included), `owner`, `attempts` (oldest first, each with `workers` by rank) and
    `latest_metrics` (`{name: {step, value}}`). None when missing or not visible to the
    viewer. Every route that answers with a job builds it from this."""
    if len(job_id) > 64:
        return None
    conn = _connection(db)
    stmt = snapshot_stmt("postgresql" if is_postgres(conn) else "sqlite", viewer.is_admin)
    row = conn.execute(stmt, viewer_params(viewer, job_id)).mappings().first()
    return None if row is None else snapshot_from_row(dict(row))


def snapshot_from_row(out: dict[str, Any]) -> dict[str, Any]:
    """The snapshot statement's row (a dict, changed in place) as job_snapshot returns it:
    attempts oldest first with workers by rank, their times parsed."""
    attempts = sorted(out["attempts"] or [], key=lambda a: a["number"])
    for a in attempts:
        a["workers"] = sorted(a["workers"] or [], key=lambda w: w["rank"])
        for k in ("created_at", "started_at", "ended_at"):
            a[k] = _parse_time(a[k])
    out["attempts"] = attempts
    out["latest_metrics"] = out["latest_metrics"] or {}
    return out


# --- the version: what a conditional GET reads instead of the whole job ----------------

VERSION_STMTS = {
    True: select(Job.version).where(Job.id == bindparam("job_id")),
    False: select(Job.version).where(
        Job.id == bindparam("job_id"), Job.project_id.in_(visible_projects_param())
    ),
}


def job_version(db: Session | Connection, viewer: Viewer, job_id: str) -> int | None:
    """The job's version (one primary-key read), or None when it is missing or not
    visible to the viewer. It changes whenever the job row or its metrics do."""
    if len(job_id) > 64:
        return None
    version = (
        _connection(db)
        .execute(VERSION_STMTS[viewer.is_admin], viewer_params(viewer, job_id))
        .scalar()
    )
    return int(version) if version is not None else None


def bump_version(session: Session, job_id: str) -> None:
    """Mark the job changed where no job column is written (a batch of metrics), so that a
    conditional GET does not answer 304 with old data. Every UPDATE of the row bumps it
    already (Job.version's onupdate): a batch writer that also sets `progress` needs
    no call."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(version=Job.version + 1)
        .execution_options(synchronize_session=False)
    )


def bump_version_sql(
    job_id_sql: str, progress: tuple[int, dict[str, Any]] | None, *, postgres: bool
) -> tuple[str, list[BindParameter[Any]]]:
    """`bump_version` for the job whose id `job_id_sql` gives (a parameter, or a subquery of
    the statement this one ends: a worker's flush, store/attempts.py), as SQL text (cheaper
    to run per batch than a Core construct). With `progress` (attempt number, progress)
    it also writes the job's progress while that attempt is the job's current one (as
    `set_progress`). Returns the SQL and its parameters (:now, :number, :progress)."""
    sets = "version = version + 1, updated_at = :now"
    if progress is not None:
        value = "CAST(:progress AS json)" if postgres else ":progress"  # SQLite: JSON text
        sets += f", progress = CASE WHEN attempt = :number THEN {value} ELSE progress END"
    binds = [bindparam("now", utcnow(), type_=Job.updated_at.type)]
    if progress is not None:
        binds += [bindparam("number", progress[0]), bindparam("progress", progress[1], JSON)]
    return f"UPDATE jobs SET {sets} WHERE id = {job_id_sql}", binds


def set_progress(
    session: Session, job_id: str, attempt_number: int, progress: dict[str, Any]
) -> None:
    """The one write of a job's progress (a worker's flush): only while `attempt_number` is
    the job's current attempt, so a late batch of an ended attempt cannot overwrite it."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt_number)
        .values(progress=progress)
        .execution_options(synchronize_session=False)
    )


def bump_version_of_attempt(session: Session, attempt_id: int) -> None:
    """`bump_version` for a write to an attempt row (pid, start time, endpoint, ending), which
    GET /v1/jobs/{id} shows but which does not UPDATE the job row."""
    job_id = select(Attempt.job_id).where(Attempt.id == attempt_id).scalar_subquery()
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(version=Job.version + 1)
        .execution_options(synchronize_session=False)
    )
