"""Checkpoint rows: recorded by the worker when the trainer announces a complete file; and
where a recorded checkpoint's file is in storage (its key, checked; an artifact's too,
store/artifacts.py: its file is kept the same way)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from torchyard.storage import Storage
from torchyard.storage.keys import UnsafePath
from torchyard.store.models import Artifact, Checkpoint

StoredFile = Checkpoint | Artifact  # a row naming a job file by path and sha256


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


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    """A job's checkpoints still on record (not deleted), oldest step first."""
    return list(
        session.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.deleted.is_(False))
            .order_by(Checkpoint.step, Checkpoint.id)
        )
    )


def get_checkpoint(session: Session, job_id: str, checkpoint_id: int) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(
            Checkpoint.job_id == job_id,
            Checkpoint.id == checkpoint_id,
            Checkpoint.deleted.is_(False),
        )
    )


def latest_checkpoint(session: Session, job_id: str, kind: str = "resume") -> Checkpoint | None:
    """The newest (highest step, then newest record) non-deleted checkpoint of `kind`."""
    return session.scalar(
        select(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.kind == kind,
            Checkpoint.deleted.is_(False),
        )
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    )


def checkpoint_key(storage: Storage, row: StoredFile) -> str:
    """The storage key to read a checkpoint's file from (`Storage.recorded_file_key`: in
    an object store it names the recorded sha256 too, or it is an earlier release's plain
    key); UnsafePath when its recorded path would leave its job's folder."""
    return storage.recorded_file_key(row.job_id, row.path, row.sha256)


def checkpoint_file(storage: Storage, row: StoredFile) -> Path | None:
    """Check that a checkpoint's file is there: UnsafePath when it would leave its job's
    folder (symlinks resolved), FileNotFoundError when it is gone. Returns its own local
    file where the backend has one (what a FileResponse serves), else None (read it
    through `storage` by `checkpoint_key`)."""
    key = storage.checkpoint_key(row.job_id, row.path, row.sha256)
    path = storage.local_path(key)
    if path is None:  # an object store: one HEAD (two for an earlier release's key)
        if storage.find_recorded_file(row.job_id, row.path, row.sha256) is None:
            raise FileNotFoundError(row.path)
        return None
    if not path.is_file():
        raise FileNotFoundError(row.path)
    return path


def checkpoint_available(storage: Storage, row: StoredFile) -> bool:
    """Whether the checkpoint's file can be served (there, and inside its job's folder)."""
    try:
        checkpoint_file(storage, row)
    except (UnsafePath, OSError):
        return False
    return True


def mark_deleted(session: Session, job_id: str, paths: list[str]) -> list[tuple[str, str]]:
    """Mark checkpoints whose files the trainer pruned (keep_last) as deleted; the (path,
    sha256) of each such row (what names its stored object)."""
    if not paths:
        return []
    rows = session.execute(
        update(Checkpoint)
        # Rows already marked are returned again: a batch retried after an ambiguous commit
        # still deletes their objects (a second delete is harmless).
        .where(Checkpoint.job_id == job_id, Checkpoint.path.in_(paths))
        .values(deleted=True)
        .returning(Checkpoint.path, Checkpoint.sha256)
        .execution_options(synchronize_session=False)
    ).all()
    return [(p, h) for p, h in rows]


def unrecorded_files(
    session: Session, job_id: str, files: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Of `files` (path, sha256), those no listed checkpoint row of the job names: objects
    an upload left that nothing records (a checkpoint superseded while it went up)."""
    if not files:
        return []
    named = session.execute(
        select(Checkpoint.path, Checkpoint.sha256).where(
            Checkpoint.job_id == job_id,
            Checkpoint.path.in_([p for p, _ in files]),
            Checkpoint.deleted.is_(False),
        )
    ).all()
    listed = {(p, h) for p, h in named}
    return [f for f in files if f not in listed]


def init_checkpoint(session: Session, job_id: str, which: str | int) -> Checkpoint | None:
    """The checkpoint a spec's `init: {from_job, checkpoint}` names: `weights` (the final
    weights), `latest` (the final weights when there are some, else the newest resume
    checkpoint) or a step number (the resume checkpoint of that step)."""
    if which == "weights":
        return latest_checkpoint(session, job_id, kind="weights")
    if which == "latest":
        return latest_checkpoint(session, job_id, kind="weights") or latest_checkpoint(
            session, job_id
        )
    return session.scalar(
        select(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.kind == "resume",
            Checkpoint.step == int(which),
            Checkpoint.deleted.is_(False),
        )
        .order_by(Checkpoint.id.desc())
        .limit(1)
    )


def recorded_sha256(session: Session, job_id: str, path: str) -> str | None:
    """The sha256 on record for a job's checkpoint file (None: none recorded)."""
    return session.scalar(
        select(Checkpoint.sha256).where(Checkpoint.job_id == job_id, Checkpoint.path == path)
    )
