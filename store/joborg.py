"""Organising jobs: tags, notes, archiving, and deleting an ended job (its rows, then its
files), with who may do each.

Tags live twice: the job's `tags` column (shown) and `job_tags` rows (what the tag filter
reads); `set_tags` is the one writer of both. Every change here updates the job row, so its
version (the ETag) moves, and adds an `edited` job event, which the dashboard's change feed
(store/uijobs.py) sees even for an ended job; the SSE feed skips events that are not state
changes.

Deletion: rows first, committed, then files. A crash between the two leaves files nobody
points at (harmless, and found by listing `jobs/<id>/` of a job that no longer exists),
never rows pointing at missing files. The file step is idempotent: an object already gone
is no error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from torchyard.contracts import spec as job_spec
from torchyard.storage import Storage, job_prefix
from torchyard.store.models import (
    Artifact,
    Assignment,
    Attempt,
    Checkpoint,
    IdempotencyKey,
    Job,
    JobEvent,
    JobTag,
    Metric,
    MetricBlock,
    SweepTrial,
    utcnow,
)
from torchyard.store.projects import at_least
from torchyard.store.states import TERMINAL

log = logging.getLogger(__name__)

# The spec's own rules (contracts/spec.py), so a tag set at submit and by PATCH agree.
TAG_RE = re.compile(job_spec.TAG_RE)
TAG_RULE = "1 to 64 letters, digits or _ . : / = + -"
MAX_TAGS = job_spec.MAX_TAGS
MAX_NOTES = job_spec.MAX_NOTES
EDITED = "edited"  # the job event type of a change made here


class JobOrgError(ValueError):
    """A refused change: `status` is the HTTP status the API answers with, `field` the
    request field at fault (422 only), `code` the error code."""

    def __init__(
        self, status: int, message: str, *, field: str | None = None, code: str | None = None
    ):
        self.status, self.message, self.field, self.code = status, message, field, code
        super().__init__(message)


def bad(field: str, message: str) -> JobOrgError:
    return JobOrgError(422, message, field=field)


# --- validation ---------------------------------------------------------------------------------


def normalise_tags(tags: object, field: str = "tags") -> list[str]:
    """`tags` checked and in their one stored form: a list of at most MAX_TAGS strings, each
    matching TAG_RE, duplicates dropped (the first kept, order kept). JobOrgError (422,
    naming `field` or `field.<index>`) otherwise; None is no tags."""
    if tags is None:
        return []
    if not isinstance(tags, list | tuple):
        raise bad(field, "must be a list of strings")
    out: list[str] = []
    for i, tag in enumerate(tags):
        if not isinstance(tag, str):
            raise bad(f"{field}.{i}", f"a tag is a string, got {type(tag).__name__}")
        if not TAG_RE.match(tag):
            raise bad(f"{field}.{i}", f"tag {tag[:80]!r} is not {TAG_RULE}")
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise bad(field, f"at most {MAX_TAGS} tags, got {len(out)}")
    return out


def normalise_notes(notes: object, field: str = "notes") -> str | None:
    """Notes as stored: a string of at most MAX_NOTES characters; "" and None are none."""
    if notes is None:
        return None
    if not isinstance(notes, str):
        raise bad(field, "must be a string (or null to clear)")
    if len(notes) > MAX_NOTES:
        raise bad(field, f"at most {MAX_NOTES} characters, got {len(notes)}")
    if "\x00" in notes:
        raise bad(field, "must not contain NUL characters")  # PostgreSQL text refuses them
    return notes or None


# --- who may --------------------------------------------------------------------------------------


def may_edit(role: str | None) -> bool:
    """Tags, notes, archive: members and owners of the job's project (admins act as owners)."""
    return at_least(role, "member")


def may_delete(role: str | None, job: Job, user_id: int) -> bool:
    """Deleting: the project's owners, or a member who submitted the job."""
    return at_least(role, "owner") or (at_least(role, "member") and job.owner_id == user_id)


# --- changes --------------------------------------------------------------------------------------


def lock(session: Session, job: Job) -> Job:
    """The job re-read under its row lock (PostgreSQL; SQLite's writers are serialised by
    BEGIN IMMEDIATE): two edits at once take turns, each seeing the other's result."""
    session.refresh(job, with_for_update=True)  # SQLite's compiler leaves FOR UPDATE out
    return job


def _edited(session: Session, job: Job, fields: Sequence[str]) -> None:
    session.add(
        JobEvent(job_id=job.id, type=EDITED, data={"fields": list(fields)}, created_at=utcnow())
    )


def set_tags(session: Session, job: Job, tags: object) -> tuple[list[str], list[str]]:
    """Replace the job's tags (column and job_tags rows together). Returns (before, after);
    nothing is written when they are equal."""
    after = normalise_tags(tags)
    before = list(job.tags or [])
    if after == before:
        return before, after
    job.tags = after  # a new list: the JSON column sees the change
    session.execute(delete(JobTag).where(JobTag.job_id == job.id))
    session.add_all(JobTag(job_id=job.id, tag=t) for t in after)
    _edited(session, job, ["tags"])
    session.flush()
    return before, after


def set_notes(session: Session, job: Job, notes: object) -> tuple[str | None, str | None]:
    """Replace the job's notes. Returns (before, after); nothing written when equal."""
    after = normalise_notes(notes)
    before = job.notes
    if after != before:
        job.notes = after
        _edited(session, job, ["notes"])
        session.flush()
    return before, after


def archive(session: Session, job: Job) -> bool:
    """Hide the job from default lists; False when it was archived already."""
    if job.archived_at is not None:
        return False
    job.archived_at = utcnow()
    _edited(session, job, ["archived"])
    session.flush()
    return True


def unarchive(session: Session, job: Job) -> bool:
    """Show the job in default lists again; False when it was not archived."""
    if job.archived_at is None:
        return False
    job.archived_at = None
    _edited(session, job, ["archived"])
    session.flush()
    return True


# --- deletion -------------------------------------------------------------------------------------


def check_deletable(session: Session, job: Job) -> None:
    """JobOrgError 409 unless the job has ended, and, for a sweep's trial, its sweep has
    recorded that end (the controller reads the trial's job until then)."""
    if job.state not in TERMINAL:
        raise JobOrgError(
            409,
            f"job {job.id} is {job.state}: only an ended job can be deleted; cancel it first",
            code="conflict",
        )
    undecided = session.scalar(
        select(SweepTrial.id).where(SweepTrial.job_id == job.id, SweepTrial.outcome.is_(None))
    )
    if undecided is not None:
        raise JobOrgError(
            409,
            f"job {job.id} is a sweep trial whose end the sweep has not recorded yet; retry "
            "in a few seconds",
            code="conflict",
        )


# Children of a job, deleted before it: assignments before the attempts they point at.
# Several have ON DELETE CASCADE, but SQLite honours it only with its foreign_keys pragma,
# and metrics have no foreign key at all (migration 0010): each is deleted by name.
_CHILDREN: tuple[Any, ...] = (
    JobTag, JobEvent, Assignment, Attempt, Checkpoint, Artifact, IdempotencyKey, Metric,
    MetricBlock,
)  # fmt: skip


def delete_rows(session: Session, job: Job) -> None:
    """Every row of the (ended: `check_deletable`) job, in the caller's transaction. A sweep
    trial keeps its row, values and outcome; only its `job_id` goes. Audit entries stay
    (they have no foreign key)."""
    job_id = job.id
    session.execute(
        update(SweepTrial)
        .where(SweepTrial.job_id == job_id)
        .values(job_id=None)
        .execution_options(synchronize_session=False)
    )
    for model in _CHILDREN:
        session.execute(
            delete(model).where(model.job_id == job_id).execution_options(synchronize_session=False)
        )
    session.execute(
        delete(Job).where(Job.id == job_id).execution_options(synchronize_session=False)
    )
    session.expunge(job)


def delete_job(session: Session, storage: Storage, job: Job) -> int:
    """Delete an ended job: its rows, committed (with whatever else the caller added to the
    session, its audit entry), then its files. Returns the number of stored objects removed.
    JobOrgError 409 for a job that has not ended."""
    lock(session, job)
    check_deletable(session, job)
    job_id = job.id
    delete_rows(session, job)
    # Rows first: from this commit on nothing points at the files, so a crash before they
    # are gone leaves orphans, never a job whose checkpoints are missing.
    session.commit()
    try:
        return delete_files(storage, job_id)
    except OSError as e:  # the store out of reach: the job is gone, its files are orphans
        log.warning("job %s deleted, but its files were not: %s", job_id, e)
        return 0


def delete_files(storage: Storage, job_id: str) -> int:
    """Every stored object under the job's prefix (`jobs/<id>/`), through the storage seam,
    then what is left of its run directory on this host (empty folders, temporary files, a
    link a trainer made: removed, never followed). Idempotent: missing objects are skipped."""
    prefix = job_prefix(job_id)  # refuses anything but a job id
    removed = 0
    for obj in list(storage.list(prefix)):
        with contextlib.suppress(FileNotFoundError):
            removed += bool(storage.delete(obj.key))
    _remove_run_dir(storage, job_id)
    return removed


def _remove_run_dir(storage: Storage, job_id: str) -> None:
    """The job's run directory on this host, if any: for the local backend the leftovers of
    its stored objects, for an object store this host's working copy."""
    folder = storage.run_dir(job_id)
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode) or not shutil.rmtree.avoids_symlink_attacks:
        log.warning("job %s: left its run directory %s (not a plain folder here)", job_id, folder)
        return
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("job %s: could not remove all of %s: %s", job_id, folder, e)
