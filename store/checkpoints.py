"""Checkpoint rows: recorded by the worker when the trainer announces a complete file."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import Checkpoint
from store.paths import UnsafePath


def record_checkpoint(
    session: Session,
    job_id: str,
    *,
    attempt: int,
    step: int,
    epoch: float | None,
    path: str,
    bytes: int,  # the event's field name
    sha256: str,
    kind: str = "resume",
) -> Checkpoint:
    """Record a checkpoint; idempotent on (job, path): a re-announced file updates its row."""
    if path.startswith("/") or ".." in path.split("/"):
        raise UnsafePath(f"checkpoint path must be relative to the job directory: {path!r}")
    row = session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.path == path)
    )
    if row is None:
        row = Checkpoint(job_id=job_id, path=path)
        session.add(row)
    row.attempt, row.step, row.epoch = attempt, step, epoch
    row.bytes, row.sha256, row.kind, row.deleted = bytes, sha256, kind, False
    session.flush()
    return row
