"""Rows to response bodies (the tables never leave the store as they are)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from torchyard.api.schemas import (
    AttemptOut,
    AttemptWorker,
    JobOut,
    JobSummary,
    MetricPoint,
    Progress,
)
from torchyard.store.jobs import attempts_of
from torchyard.store.metrics import latest_metrics
from torchyard.store.models import Job


def _progress(job: Job) -> Progress | None:
    p = job.progress
    if not isinstance(p, dict):
        return None
    return Progress(
        step=p.get("step"),
        total_steps=p.get("total_steps"),
        epoch=p.get("epoch"),
        samples_per_s=p.get("samples_per_s"),
        eta_s=p.get("eta_s"),
    )


def _summary_fields(job: Job, owner: str) -> dict[str, object]:
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "attempt": job.attempt,
        "spec": job.spec,
        "progress": _progress(job),
        "pending_reason": job.pending_reason,
        "error": job.error,
        "created_at": job.created_at,
        "updated_at": job.updated_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "priority": job.priority,
        "world_size": job.world_size,
        "max_restarts": job.max_restarts,
        "cancel_requested": job.cancel_requested,
        "owner": owner,
    }


def job_summary(job: Job, owner: str) -> JobSummary:
    return JobSummary.model_validate(_summary_fields(job, owner))


def job_out(session: Session, job: Job, owner: str) -> JobOut:
    attempts = [
        AttemptOut(
            number=a.number,
            state=a.state,
            workers=[AttemptWorker(rank=w.rank, worker_id=w.worker_id) for w in assignments],
            rank0_endpoint=a.rank0_endpoint,
            exit_code=a.exit_code,
            reason=a.reason,
            created_at=a.created_at,
            started_at=a.started_at,
            ended_at=a.ended_at,
        )
        for a, assignments in attempts_of(session, job.id)
    ]
    latest = {
        name: MetricPoint(step=p["step"], value=p["value"])
        for name, p in latest_metrics(session, job.id).items()
    }
    return JobOut.model_validate(
        {**_summary_fields(job, owner), "latest_metrics": latest, "attempts": attempts}
    )


def job_from_snapshot(row: dict[str, Any]) -> JobOut:
    """JobOut from store.jobs.job_snapshot's one-statement row."""
    progress = row["progress"]
    return JobOut.model_validate(
        {
            **{k: row[k] for k in _JOB_COLUMNS},
            "progress": progress if isinstance(progress, dict) else None,
            "owner": row["owner"],
            "latest_metrics": row["latest_metrics"],
            "attempts": row["attempts"],
        }
    )


_JOB_COLUMNS = (
    "id", "name", "state", "attempt", "spec", "pending_reason", "error", "created_at",
    "updated_at", "started_at", "finished_at", "priority", "world_size", "max_restarts",
    "cancel_requested",
)  # fmt: skip
