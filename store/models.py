"""The tables. Each column has one writer (see docs/architecture.md):

- api: users, tokens, bundles, jobs.spec/name/owner/priority/cancel_requested, idempotency keys
- scheduler: jobs.state queued→starting, jobs.pending_reason, attempts, assignments
- worker: its own workers row, its attempt's state/exit, metrics, checkpoints, jobs.progress
Every change of jobs.state goes through `store.states.transition`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    literal_column,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# BigInteger autoincrement primary keys are INTEGER on SQLite (rowid) and BIGSERIAL on PostgreSQL.
BigId = BigInteger().with_variant(Integer(), "sqlite")


# jobs.hold_until of a sweep trial paused at a rung (pruner halving): held until the sweep's
# controller releases it (store/lifecycle.py, scheduler/sweeps.py).
PAUSED_HOLD = datetime(9999, 1, 1, tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both databases (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    pass


def table_of(model: type[Base]) -> Table:
    """A model's Table, typed as one (DeclarativeBase declares `__table__` a FromClause),
    for the Core statements of the hot paths."""
    table = model.__table__
    assert isinstance(table, Table)
    return table


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    # Jobs of this user may run their own code (bundles, scripts, module:function
    # factories), which runs with the worker's privileges: granted by an admin only.
    can_run_code: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=false(), nullable=False
    )
    # The pool's limits, set by an admin (PUT /v1/users/{name}/quota); None: no limit.
    max_workers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Fair share: usage is divided by this, so a share of 2 may use twice as much.
    share: Mapped[float] = mapped_column(Float, default=1.0, server_default="1", nullable=False)
    # The highest priority the user may give a job, and the priority up to which their
    # running jobs are safe from other users' (store/quotas.py); None: the default, 0.
    max_priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Project(Base):
    """A project: the unit of sharing (store/projects.py). Every user has a personal one,
    named `~<user>`, made with the user; every job and sweep belongs to exactly one."""

    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(101), unique=True)
    # The user whose personal project this is; None for a team's project.
    personal_of: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), nullable=True, unique=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The project's limits in the pool, set by an admin, on top of each user's own
    # (store/quotas.py says how they combine); None: no limit.
    max_workers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued: Mapped[int | None] = mapped_column(Integer, nullable=True)
    share: Mapped[float] = mapped_column(Float, default=1.0, server_default="1", nullable=False)


class ProjectMember(Base):
    """A user's role in a project: viewer (reads), member (also submits and cancels),
    owner (also manages members)."""

    __tablename__ = "project_members"
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[int] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
    )
    role: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    # Every visibility check reads "the projects of user U" (store/projects.py: visible_to).
    __table_args__ = (Index("ix_project_members_user", "user_id", "project_id"),)


class AuditEntry(Base):
    """One change a person made (store/audit.py), written in the change's own transaction.
    Append-only: the migration adds triggers that refuse UPDATE and DELETE on both
    databases. No foreign keys, so that deleting a job or a project leaves its entries."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    user_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    user_name: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(300))
    # The project the target belongs to, for its owners' view of the trail; None: none.
    project_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    client: Mapped[str | None] = mapped_column(String(100), nullable=True)

    __table_args__ = (
        Index("ix_audit_log_project", "project_id", "id"),
        Index("ix_audit_log_user", "user_name", "id"),
        Index("ix_audit_log_action", "action", "id"),
    )


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    # sha256 of the token: a stolen database yields no usable token.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # What its owner calls it (`torchyard token create --label`), shown in GET /v1/tokens.
    label: Mapped[str | None] = mapped_column(String(100), nullable=True)


class Bundle(Base):
    """A code bundle a user uploaded (POST /v1/bundles). The id is the sha256 of the
    uploaded bytes, so the same bytes from two users are one file on disk
    (`<storage>/bundles/<id>.tar.gz`) but two rows: each user owns only what they uploaded."""

    __tablename__ = "bundles"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)  # the upload's (compressed) size
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Uploaded again or named by a submitted job (store/bundles.py); a bundle unused for
    # TORCHYARD_BUNDLE_RETENTION_S is removed. None: never since created_at.
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))  # ix_jobs_owner_created
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # spec.preemptible: a higher-priority job may stop it (it resumes from its checkpoint).
    preemptible: Mapped[bool] = mapped_column(
        Boolean, default=True, server_default=true(), nullable=False
    )
    max_restarts: Mapped[int] = mapped_column(Integer, default=2)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    # 1 for the first try; a lost attempt re-queues the job with attempt + 1.
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    pending_reason: Mapped[str | None] = mapped_column(String(300), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Latest progress from the trainer: step, total_steps, epoch, samples_per_s, eta_s.
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # +1 on every UPDATE of the row, whoever writes it (onupdate), and for metrics by
    # store.jobs.bump_version: the ETag of GET /v1/jobs/{id} and its /metrics.
    version: Mapped[int] = mapped_column(
        BigInteger, default=0, server_default="0", onupdate=literal_column("version + 1")
    )
    # The sweep this job is a trial of (store/sweeps.py); no foreign key, so that adding the
    # column rebuilds no table on SQLite.
    sweep_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # A job handed back again and again waits until then before a pass may start it
    # (store/lifecycle.py: hand-back backoff; migration 0012). None: no wait. PAUSED_HOLD:
    # a sweep trial paused at a rung, until its controller releases it.
    hold_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The project the job belongs to (store/projects.py). Nullable and without a foreign
    # key so that migration 0016 adds it without rebuilding `jobs` on SQLite; every job
    # stored since has one.
    project_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Labels and a free note, changed later through PATCH /v1/jobs/{id}; the tags are also
    # rows of job_tags, which the tag filter reads.
    tags: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    notes: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Hidden from the default lists since then (POST /v1/jobs/{id}/archive); None: shown.
    archived_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The job this one re-runs (`torchyard rerun`), if any.
    rerun_of: Mapped[str | None] = mapped_column(String(32), nullable=True)

    __table_args__ = (
        # Jobs by state (lists and counts), then priority and age.
        Index("ix_jobs_state_priority_created", "state", "priority", "created_at"),
        Index("ix_jobs_owner_created", "owner_id", "created_at"),
        # Free space in each page (migration 0009): an update that changes no indexed
        # column (pending reason, progress, version) stays in its page and writes no index.
        {"postgresql_with": {"fillfactor": 70}},
    )


Index("ix_jobs_project_created", Job.project_id, Job.created_at)


class JobTag(Base):
    """One tag of a job, for the tag filter (GET /v1/jobs?tag=); the job's `tags` column
    holds the same list for display. Both are written together (store/joborg.py)."""

    __tablename__ = "job_tags"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)

    __table_args__ = (Index("ix_job_tags_tag", "tag", "job_id"),)


# A sweep's trials; most jobs are none (no entry for NULL).
Index(
    "ix_jobs_sweep_id",
    Job.sweep_id,
    postgresql_where=Job.sweep_id.is_not(None),
    sqlite_where=Job.sweep_id.is_not(None),
)
# The scheduler's queue head: only queued jobs, already in pass order, so the head of a
# 100k-job queue is read off the index without sorting every queued job. Fair share reads
# each user's head apart (store/queue.py: queue_heads).
Index(
    "ix_jobs_queued_owner_order",
    Job.owner_id,
    Job.priority.desc(),
    Job.created_at,
    Job.id,
    postgresql_where=Job.state == "queued",
    sqlite_where=Job.state == "queued",
)


class JobEvent(Base):
    """Append-only history of a job: state changes and notable happenings (SSE reads it)."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Attempt(Base):
    """One try at running a job: who ran it, when, how it ended."""

    __tablename__ = "attempts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through uq_attempts_job_number (job_id first).
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    # starting, running, succeeded, failed, lost, handed_back, cancelled
    state: Mapped[str] = mapped_column(String(16), default="starting")
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    rank0_endpoint: Mapped[str | None] = mapped_column(String(300), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    resumed_from: Mapped[str | None] = mapped_column(String(500), nullable=True)
    # Set by the scheduler: the queued job this attempt is stopped for (preemption). The
    # supervisor sees it, stops the trainer with SIGTERM and hands the job back.
    preempted_by: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Bytes of the job's events.jsonl ingested into the store by this attempt's supervisor,
    # committed with the rows they produced: whoever supervises next continues from here.
    events_offset: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
        # Fair share reads the attempts that ended within its horizon (store/usage.py).
        Index("ix_attempts_ended_at", "ended_at"),
        # The scheduler reads the preemptions in flight each pass (no entry for NULL).
        Index(
            "ix_attempts_preempted_by",
            "preempted_by",
            postgresql_where=literal_column("preempted_by IS NOT NULL"),
            sqlite_where=literal_column("preempted_by IS NOT NULL"),
        ),
    )


class Assignment(Base):
    """One rank of an attempt given to one worker. `claimed_at` is the lease: a worker
    claims it with a conditional update, so a message delivered twice starts one trainer."""

    __tablename__ = "assignments"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through uq_assignments_attempt_rank (attempt_id first).
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id"), index=True)
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (UniqueConstraint("attempt_id", "rank", name="uq_assignments_attempt_rank"),)


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    gpu: Mapped[int | None] = mapped_column(Integer, nullable=True)
    device: Mapped[str] = mapped_column(String(16), default="cpu")
    device_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    queue: Mapped[str] = mapped_column(String(200))
    # idle, busy, lost, stopped
    state: Mapped[str] = mapped_column(String(16), default="idle")
    current_job_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    current_assignment_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Since when its warm trainer has been ready for a one-rank job; null: none ready
    # (store/workers.py; placement prefers warm workers, migration 0015).
    warm_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


def _bytewise(length: int) -> String:
    """A metric key column: compared bytewise on PostgreSQL (COLLATE "C", as SQLite does
    always), cheaper in every index comparison of the ingest path (migration 0010)."""
    return String(length).with_variant(String(length, collation="C"), "postgresql")


class Metric(Base):
    """A point of a series. No foreign key to `jobs` (migration 0010): a job is deleted
    only once ended (store/joborg.py deletes its points with it), and every write of points
    is fenced by an active attempt of the job (so it exists); the check, a lookup and a row lock on the job per point, cost ~8 µs of
    server CPU per point, about half of the ingest's."""

    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(_bytewise(32))
    name: Mapped[str] = mapped_column(_bytewise(100))
    step: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[float | None] = mapped_column(Float, nullable=True)
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[float] = mapped_column(Float)

    # Idempotent ingest: a replay after resume leaves one row per (job, name, step).
    __table_args__ = (UniqueConstraint("job_id", "name", "step", name="uq_metrics_job_name_step"),)


class MetricBlock(Base):
    """Rollup of a metric over aligned blocks of `level` steps (64 and 4096), kept by
    `store.metrics.ingest_metrics`, so that downsampling a million-point curve reads a few
    thousand rows instead of every point. No foreign key to `jobs`, as `Metric`."""

    __tablename__ = "metric_blocks"
    job_id: Mapped[str] = mapped_column(_bytewise(32), primary_key=True)
    name: Mapped[str] = mapped_column(_bytewise(100), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    # steps block * level .. (block + 1) * level - 1
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    vmin: Mapped[float] = mapped_column(Float)
    vmax: Mapped[float] = mapped_column(Float)
    last_step: Mapped[int] = mapped_column(BigInteger)
    n: Mapped[int] = mapped_column(Integer)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[float | None] = mapped_column(Float, nullable=True)
    # "resume" (full training state, .pt) or "weights" (final safetensors export)
    kind: Mapped[str] = mapped_column(String(16), default="resume")
    # Relative to the job's directory under the storage root; never absolute.
    path: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (UniqueConstraint("job_id", "path", name="uq_checkpoints_job_path"),)


class Artifact(Base):
    """A file a script job kept with `job.save_artifact` (`artifacts/<name>` of its run dir;
    migration 0021). One row per name: saving a name again replaces the row."""

    __tablename__ = "artifacts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # Relative to the job's directory: always artifacts/<name>.
    path: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))  # measured by the worker
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (UniqueConstraint("user_id", "key", name="uq_idempotency_user_key"),)


class Sweep(Base):
    """A hyperparameter search (POST /v1/sweeps): trials are ordinary jobs of the owner, each
    the base `spec` with values of `space` set at dotted paths. The controller
    (scheduler/sweeps.py) asks Optuna for them; its study is named by the sweep's id."""

    __tablename__ = "sweeps"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the base spec, as given
    space: Mapped[dict[str, Any]] = mapped_column(JSON)
    metric: Mapped[str] = mapped_column(String(100))
    mode: Mapped[str] = mapped_column(String(8))  # min, max
    # Trials to run in all (a grid's size at most) and at most at once.
    max_trials: Mapped[int] = mapped_column(Integer)
    parallel: Mapped[int] = mapped_column(Integer)
    sampler: Mapped[str] = mapped_column(String(16))  # random, tpe, grid
    pruner: Mapped[str] = mapped_column(String(16))  # none, median, asha, halving
    seed: Mapped[int] = mapped_column(BigInteger)
    # running, succeeded, failed, cancelled
    state: Mapped[str] = mapped_column(String(16), default="running")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Its project (the trials' too); nullable and without a foreign key as jobs.project_id.
    project_id: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (
        Index("ix_sweeps_owner_created", "owner_id", "created_at"),
        Index("ix_sweeps_state", "state"),
    )


# SweepTrial.outcome's values.
TRIAL_COMPLETE, TRIAL_PRUNED, TRIAL_FAILED, TRIAL_CANCELLED = (
    "complete",
    "pruned",
    "failed",
    "cancelled",
)


class SweepTrial(Base):
    """One trial of a sweep: Optuna's trial `number`, the values it sampled and the job that
    runs them (None when they made an invalid spec). `outcome` is None while the trial runs,
    then complete, pruned or failed: what Optuna is (or is about to be) told."""

    __tablename__ = "sweep_trials"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), nullable=True, index=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # The objective's newest point reported to Optuna (the final value once complete).
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # `pruner: halving`: the evaluation (rung) the trial waits at, its job held in the queue
    # until the controller releases or prunes it (None: not paused).
    paused_rung: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),)


# The controller's pass reads the trials still running (a cancelled sweep's too).
Index(
    "ix_sweep_trials_open",
    SweepTrial.sweep_id,
    postgresql_where=SweepTrial.outcome.is_(None),
    sqlite_where=SweepTrial.outcome.is_(None),
)


class _UiSecret:
    """A dashboard secret, stored hashed, belonging to the API token that made it."""

    secret_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class UiLoginLink(_UiSecret, Base):
    """A one-time login link of the dashboard (`torchyard ui`): exchanged once, within
    minutes, for a session of the token that made it."""

    __tablename__ = "ui_login_links"
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class UiSession(_UiSecret, Base):
    """A dashboard session (its secret is the HttpOnly cookie). It acts as the token it
    was made from: revoking that token ends it."""

    __tablename__ = "ui_sessions"


class SsoLogin(Base):
    """A dashboard sign-in under way at the OpenID provider (store/sso.py): found by the
    sha256 of its `state`, bound to the browser that started it (the sha256 of a cookie),
    good once and for minutes. The nonce and PKCE verifier are sent on from here."""

    __tablename__ = "sso_logins"
    state_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    browser_hash: Mapped[str] = mapped_column(String(64))
    nonce: Mapped[str] = mapped_column(String(64))
    code_verifier: Mapped[str] = mapped_column(String(128))
    # Where the dashboard goes after the sign-in: one of its own paths, checked.
    next_path: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)


class UserIdentity(Base):
    """A user's account at an OpenID provider (its issuer and `sub`): bound at the first
    single sign-on, after which only that account signs in as the user. `granted` is what
    the provider's groups gave at the last sign-in ({"admin": bool, "projects": {name:
    role}}), so that leaving a group takes away what it gave and nothing else."""

    __tablename__ = "user_identities"
    issuer: Mapped[str] = mapped_column(String(300), primary_key=True)
    subject: Mapped[str] = mapped_column(String(255), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    granted: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_login_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (UniqueConstraint("issuer", "user_id", name="uq_user_identities_user"),)


class Webhook(Base):
    """A subscription to job and sweep endings (store/webhooks.py): each event it names is
    POSTed to `url`, signed with `secret` (kept, since signing needs it; the API shows it
    once). It belongs to its owner (their own jobs and sweeps) or, with `project_id`, to a
    project (every job and sweep of it; its owners manage it)."""

    __tablename__ = "webhooks"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    project_id: Mapped[int | None] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), nullable=True
    )
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(256))
    active: Mapped[bool] = mapped_column(
        Boolean, default=True, server_default=true(), nullable=False
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (
        Index("ix_webhooks_owner", "owner_id"),
        Index("ix_webhooks_project", "project_id"),
    )


class WebhookDelivery(Base):
    """The outbox: one event for one webhook, written in the transaction of the state change
    it reports (store/webhooks.py), sent by scheduler/notify.py. `id` is the delivery's id
    (X-Torchyard-Delivery, the same on every retry); `seq` orders the deliveries of one
    (webhook, subject); `lease_until` is a sender's claim, which expires if it dies."""

    __tablename__ = "webhook_deliveries"
    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str] = mapped_column(String(32))  # the job's or the sweep's id
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)  # the body, frozen at the change
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # pending, delivered, failed (gave up a day after created_at)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(100), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        Index("ix_webhook_deliveries_webhook", "webhook_id", "seq"),
        # The sender's claim reads the pending ones only (no entry once sent or given up).
        Index(
            "ix_webhook_deliveries_pending",
            "webhook_id",
            "subject",
            "seq",
            postgresql_where=literal_column("state = 'pending'"),
            sqlite_where=literal_column("state = 'pending'"),
        ),
    )


class WebhookAttempt(Base):
    """One try at sending a delivery: when, how long, what the receiver answered (or why
    nothing was sent). GET /v1/webhooks/{id}/deliveries shows them."""

    __tablename__ = "webhook_attempts"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE")
    )
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    duration_ms: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (Index("ix_webhook_attempts_delivery", "delivery_id", "id"),)


class SandboxUid(Base):
    """Each user's host uid in the sandbox of a root worker (store/sandboxuids.py): given
    once, from TORCHYARD_SANDBOX_UID + 1 upward, and never given to another user (a row is
    never removed; users are never deleted)."""

    __tablename__ = "sandbox_uids"
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), primary_key=True)
    uid: Mapped[int] = mapped_column(Integer, unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
