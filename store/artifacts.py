"""Artifact rows: the files a script job keeps with `job.save_artifact`, recorded by its
worker (one row per name, the sha256 and size it measured; saving a name again replaces the
row), listed and found for download. Their files are kept as checkpoints' are
(store/checkpoints.py: `checkpoint_key`, `checkpoint_file`)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from torchyard.contracts.eventmodel import ARTIFACT_DIR, artifact_name_problem
from torchyard.storage.keys import UnsafePath
from torchyard.store.models import Artifact, utcnow


def record_artifact(
    session: Session, job_id: str, *, name: str, bytes: int, sha256: str
) -> str | None:
    """Record (or replace) the artifact `name` of a job; the sha256 it held before when that
    was another (its stored object is no longer named by any row), else None."""
    if problem := artifact_name_problem(name):
        raise UnsafePath(problem)
    row = session.scalar(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name))
    before = None
    if row is None:
        row = Artifact(job_id=job_id, name=name, path=f"{ARTIFACT_DIR}/{name}")
        session.add(row)
    elif row.sha256 != sha256:
        before = row.sha256
    row.bytes, row.sha256, row.created_at = bytes, sha256, utcnow()
    session.flush()
    return before


def list_artifacts(session: Session, job_id: str) -> list[Artifact]:
    """A job's artifacts by name."""
    return list(
        session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name))
    )


def get_artifact(session: Session, job_id: str, name: str) -> Artifact | None:
    return session.scalar(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name))


def artifact_names(session: Session, job_id: str) -> set[str]:
    """The names a job has kept (what its worker counts against EventLimits.artifacts)."""
    return set(session.scalars(select(Artifact.name).where(Artifact.job_id == job_id)))
