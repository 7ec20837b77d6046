"""Response bodies of the API, kept apart from the tables: what clients may rely on.

`state` fields are typed with the contracts' enums, so the OpenAPI document lists their
values; they serialise as the plain names (`use_enum_values`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from torchyard.contracts.states import AttemptState, JobState, WorkerState


class _Out(BaseModel):
    # use_enum_values: a validated state is its plain name, in model_dump as in JSON
    model_config = ConfigDict(from_attributes=True, use_enum_values=True)


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable: unauthorized, not_found, conflict, ...")
    message: str = Field(description="human-readable, naming what to fix")
    details: Any = Field(default=None, description="for validation errors: [{field, message}, ...]")


class ErrorBody(BaseModel):
    error: ErrorDetail


class Progress(_Out):
    step: int | None = None
    total_steps: int | None = None
    epoch: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None


class AttemptWorker(_Out):
    rank: int
    worker_id: str


class AttemptOut(_Out):
    number: int
    state: AttemptState
    workers: list[AttemptWorker]
    rank0_endpoint: str | None
    exit_code: int | None
    reason: str | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


class MetricPoint(BaseModel):
    step: int
    value: float | None


class JobSummary(_Out):
    """A job as listed: everything but its attempts and latest metrics."""

    id: str
    name: str
    state: JobState = Field(description="its transitions: GET /v1/states")
    attempt: int
    spec: dict[str, Any] = Field(description="the normalised spec, every default written out")
    progress: Progress | None
    pending_reason: str | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    priority: int
    world_size: int
    max_restarts: int
    cancel_requested: bool
    owner: str
    project: str | None = Field(description="the project it belongs to (`~<user>`: personal)")
    tags: list[str] = Field(description="set at submit or by PATCH; filter with ?tag=")
    notes: str | None
    archived: bool = Field(description="hidden from default lists (POST .../archive)")
    archived_at: datetime | None
    rerun_of: str | None = Field(description="the job this one re-runs, if any")
    sweep_id: str | None = Field(default=None, description="the sweep it is a trial of, if any")
    pruned: bool = Field(
        default=False,
        description="its sweep's pruner stopped it at a rung: its state is cancelled (or "
        "cancelling) though nobody cancelled it",
    )


class JobOut(JobSummary):
    """A job with its newest point of every metric and every attempt."""

    latest_metrics: dict[str, MetricPoint]
    attempts: list[AttemptOut]


class SpecWarning(BaseModel):
    field: str = Field(description="the spec field it is about, dotted (`world_size`)")
    message: str = Field(description="what will happen, naming what the server knows")


class SubmittedJob(JobOut):
    """The job a submit stored, with what in its spec is allowed but likely not meant."""

    warnings: list[SpecWarning] = Field(
        default_factory=list,
        description="the job is stored and queued all the same: a world_size above the "
        "workers registered now, a batch_size above the training set's size",
    )


class JobList(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null: none")


class Series(BaseModel):
    steps: list[int]
    values: list[float | None]
    min: list[float | None] | None = Field(
        default=None, description="with max_points only: each point's bucket minimum"
    )
    max: list[float | None] | None = Field(
        default=None, description="with max_points only: each point's bucket maximum"
    )
    times: list[float] | None = Field(
        default=None, description="with times=true (raw pages): each point's Unix time"
    )


class MetricsOut(BaseModel):
    series: dict[str, Series]
    next_after_step: int | None = Field(
        default=None,
        description="without max_points only: the curves were cut at this step (at most "
        "TORCHYARD_METRICS_PAGE_POINTS points each, TORCHYARD_METRICS_PAGE_TOTAL_POINTS in "
        "all); ask again with after_step set to it. Absent when they are complete.",
    )
    capped: bool | None = Field(
        default=None,
        description="true when the bound on all curves together "
        "(TORCHYARD_METRICS_PAGE_TOTAL_POINTS) made this page shorter than "
        "TORCHYARD_METRICS_PAGE_POINTS a curve (follow next_after_step), or, with max_points, "
        "its buckets wider than asked; absent otherwise.",
    )


class LogChunk(BaseModel):
    data: str = Field(
        description="text of bytes offset..next_offset (UTF-8, never cut mid-character)"
    )
    offset: int
    next_offset: int = Field(description="ask for this offset next")
    size: int = Field(description="size of the whole log in bytes now")
    complete: bool = Field(description="the job has ended and next_offset reached its size")


class LogLine(BaseModel):
    offset: int = Field(description="byte offset of the line's start in the log")
    text: str = Field(description="the line without its ending, cut at 4 KiB (UTF-8 kept whole)")


class LogMatch(LogLine):
    cut: bool = Field(description="the line was longer than 4 KiB and is cut")
    before: list[LogLine] = Field(description="up to `context` lines before it")
    after: list[LogLine] = Field(description="up to `context` lines after it")


class LogMatches(BaseModel):
    """`GET /v1/jobs/{id}/logs?grep=`: the matching lines of one bounded scan."""

    matches: list[LogMatch]
    offset: int = Field(description="where this scan began")
    next_offset: int = Field(description="ask again with offset = next_offset to go on")
    size: int = Field(description="size of the whole log in bytes when the scan began")
    scanned: int = Field(description="bytes searched by this request")
    complete: bool = Field(description="the scan reached the end of the log (as it was)")
    stopped_early: bool = Field(
        default=False,
        description="the scan stopped at its time bound (TORCHYARD_LOG_GREP_MAX_S) before "
        "its byte budget: what it found is here; go on from next_offset",
    )


class CheckpointOut(_Out):
    id: int
    step: int
    epoch: float | None
    kind: str = Field(description="resume (full training state, .pt) or weights (safetensors)")
    bytes: int
    sha256: str
    attempt: int
    path: str = Field(description="relative to the job's directory")
    created_at: datetime
    available: bool = Field(description="the file is on disk and can be downloaded")


class CheckpointList(BaseModel):
    items: list[CheckpointOut]
    next_cursor: str | None = None


class ArtifactOut(_Out):
    name: str
    bytes: int = Field(description="measured by the job's worker")
    sha256: str = Field(description="measured by the job's worker; the download's ETag")
    path: str = Field(description="relative to the job's directory: artifacts/<name>")
    created_at: datetime = Field(description="when this name was last saved")
    available: bool = Field(description="the file is in storage and can be downloaded")


class ArtifactList(BaseModel):
    items: list[ArtifactOut]


class WorkerOut(_Out):
    id: str
    host: str
    pid: int
    gpu: int | None
    device: str
    device_name: str | None
    memory_bytes: int | None
    state: WorkerState
    current_job_id: str | None
    last_heartbeat: datetime
    registered_at: datetime


class WorkerList(BaseModel):
    items: list[WorkerOut]
    next_cursor: str | None = None


class JobStateLists(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    states: list[JobState] = Field(description="every job state, in the order of a job's life")
    terminal: list[JobState] = Field(description="states a job never leaves")
    active: list[JobState] = Field(description="states in which a job holds workers")
    transitions: dict[JobState, list[JobState]] = Field(
        description="each state → the states it may change to"
    )


class AttemptStateLists(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    states: list[AttemptState]
    active: list[AttemptState] = Field(description="an attempt under way")
    counted: list[AttemptState] = Field(description="ends counted against max_restarts")


class WorkerStateLists(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    states: list[WorkerState]
    live: list[WorkerState] = Field(description="registered and heartbeating")


class StateLists(BaseModel):
    """Every state name and list clients need (contracts/states.py: state_lists)."""

    job: JobStateLists
    attempt: AttemptStateLists
    worker: WorkerStateLists


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    database: bool
    broker: bool


class BundleOut(BaseModel):
    id: str = Field(description="sha256 of the uploaded archive: name it as `code.bundle`")
    bytes: int = Field(description="size of the uploaded (compressed) archive")
    files: int = Field(description="regular files in the bundle")


# -- the pool: quotas and the queue ---------------------------------------------------------

_LIMIT_MAX = 1_000_000  # far above any pool, far below the database's integer range


class QuotaIn(BaseModel):
    """The fields to change; absent: unchanged, null: no limit (a null share: back to 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_workers: int | None = Field(
        default=None,
        ge=0,
        le=_LIMIT_MAX,
        description="most workers the user's jobs may hold at once (0: none start)",
    )
    max_queued: int | None = Field(
        default=None,
        ge=0,
        le=_LIMIT_MAX,
        description="most queued jobs the user may have; a submit over it is 429 (0: none)",
    )
    share: float | None = Field(
        default=None,
        gt=0,
        le=_LIMIT_MAX,
        allow_inf_nan=False,
        description="weight in fair share: usage is divided by it (default 1)",
    )
    max_priority: int | None = Field(
        default=None,
        ge=-1000,
        le=1000,
        description="highest priority the user may give a job (above it: 403); another "
        "user's job preempts this user's running jobs only with a priority above it "
        "(null: the default, 0)",
    )


class QuotaOut(BaseModel):
    user: str
    max_workers: int | None = Field(description="null: no limit")
    max_queued: int | None = Field(description="null: no limit")
    share: float
    max_priority: int = Field(
        description="highest priority the user may give a job (admins: any), and the "
        "priority up to which their running jobs are safe from other users' (default 0)"
    )


class ProjectQuotaIn(BaseModel):
    """A project's fields to change, as QuotaIn (no max_priority: that is a user's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_workers: int | None = Field(
        default=None,
        ge=0,
        le=_LIMIT_MAX,
        description="most workers the project's jobs (whoever submitted them) may hold at "
        "once, on top of each user's own limit (0: none start)",
    )
    max_queued: int | None = Field(
        default=None,
        ge=0,
        le=_LIMIT_MAX,
        description="most queued jobs the project may have; a submit over it is 429 (0: none)",
    )
    share: float | None = Field(
        default=None,
        gt=0,
        le=_LIMIT_MAX,
        allow_inf_nan=False,
        description="the project's weight in fair share: its usage is divided by it "
        "(default 1; a personal project's is its user's)",
    )


class ProjectQuotaOut(BaseModel):
    project: str
    max_workers: int | None = Field(description="null: no limit")
    max_queued: int | None = Field(description="null: no limit")
    share: float


class QueueUsage(BaseModel):
    worker_hours: float = Field(
        description="the owner's recent usage: worker-hours decayed with the half-life"
    )
    share: float


class QueueItem(BaseModel):
    position: int = Field(description="1: the next to start, in the whole queue")
    id: str
    name: str
    owner: str
    project: str | None = Field(default=None, description="the project the job belongs to")
    priority: int
    world_size: int
    pending_reason: str | None
    created_at: datetime
    usage: QueueUsage


class QueueCounts(BaseModel):
    queued: int = Field(description="queued jobs of every user")
    users: int = Field(description="users with queued jobs")
    mine: int = Field(description="the caller's queued jobs")


class UserUsage(QueueUsage):
    max_workers: int | None
    max_queued: int | None


class QueueOut(BaseModel):
    items: list[QueueItem] = Field(
        description="in the order they would start; a non-admin sees only their own"
    )
    counts: QueueCounts
    usage: dict[str, UserUsage] = Field(
        description="per user: every user with queued jobs (admins) or the caller only"
    )
    unit: str = Field(description="what one worker is: GPU, CPU slot or worker (mixed pool)")
    half_life_s: float
