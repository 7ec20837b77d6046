"""Response bodies of the API, kept apart from the tables: what clients may rely on."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


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
    state: str
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
    state: str = Field(
        description="queued, starting, running, succeeded, failed, cancelling, cancelled"
    )
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


class JobOut(JobSummary):
    """A job with its newest point of every metric and every attempt."""

    latest_metrics: dict[str, MetricPoint]
    attempts: list[AttemptOut]


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


class MetricsOut(BaseModel):
    series: dict[str, Series]
    next_after_step: int | None = Field(
        default=None,
        description="without max_points only: the curves were cut at this step (at most "
        "TORCHYARD_METRICS_PAGE_POINTS points each); ask again with after_step set to it. "
        "Absent when they are complete.",
    )


class LogChunk(BaseModel):
    data: str = Field(
        description="text of bytes offset..next_offset (UTF-8, never cut mid-character)"
    )
    offset: int
    next_offset: int = Field(description="ask for this offset next")
    size: int = Field(description="size of the whole log in bytes now")
    complete: bool = Field(description="the job has ended and next_offset reached its size")


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


class WorkerOut(_Out):
    id: str
    host: str
    pid: int
    gpu: int | None
    device: str
    device_name: str | None
    memory_bytes: int | None
    state: str = Field(description="idle, busy, lost, stopped")
    current_job_id: str | None
    last_heartbeat: datetime
    registered_at: datetime


class WorkerList(BaseModel):
    items: list[WorkerOut]
    next_cursor: str | None = None


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
