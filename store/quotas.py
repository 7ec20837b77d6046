"""Limits of the shared pool, per user and per project (set by an admin:
PUT /v1/users/{name}/quota, PUT /v1/projects/{name}/quota).

A user's:
- `max_queued`: a submit (or a sweep's next trial) while the user already has that many
  queued jobs is refused (the API answers 429);
- `max_workers`: the scheduler starts none of the user's jobs that would take them past
  that many workers (the job waits, its pending reason names the limit);
- `share`: the weight of the user's fair share (usage is divided by it);
- `max_priority`: the highest priority the user may give a job (a submit above it is
  refused, 403; admins are not limited), and the priority up to which the user's running
  jobs are safe from other users' jobs (scheduler/preemption.py). `None` is the default,
  `DEFAULT_MAX_PRIORITY` (0, the default job priority): a user orders their own jobs at or
  below it and preempts nobody else's work; an admin raises it for the users whose urgent
  work may take workers from others.
`None` means no limit (for `max_priority`: the default).

A project has `max_workers`, `max_queued` and `share` too (no `max_priority`: that stays
a user's). How the two combine:
- `max_workers`: a job starts only if it fits under both limits: its user's (workers held
  by the user's jobs in any project) and its project's (workers held by all the project's
  jobs, whoever submitted them). The pending reason names the limit that holds it
  (`quota: alice's jobs hold 2 of max_workers 2, this one needs 1`, `quota: project lab's
  jobs hold 4 of max_workers 4, this one needs 1`): one the job can never fit under
  first, else the one with the least room left, the user's on a tie.
- `max_queued`: a submit (or a sweep's next trial) is refused when the user has their
  max_queued queued jobs or the project has its max_queued queued jobs (whoever queued
  them); the message names which (the user's when both are full).
- `share`: fair share has two levels (scheduler/fairshare.py). Jobs of equal priority go
  first by their project's usage over the project's share, then by their user's usage
  (in every project) over the user's share. A personal project stands for its user at
  the first level: its term is the user's usage over the user's share, so with only
  personal projects the order is exactly per-user fair share. A personal project's share
  is therefore its user's; setting one on it is refused (set the user's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres
from torchyard.store.models import PAUSED_HOLD, Job, Project, User
from torchyard.store.states import QUEUED

QUOTA_FIELDS = ("max_workers", "max_queued", "share", "max_priority")
PROJECT_QUOTA_FIELDS = ("max_workers", "max_queued", "share")
# The max_priority of a user none was set for: the default job priority.
DEFAULT_MAX_PRIORITY = 0


@dataclass(frozen=True)
class Quota:
    max_workers: int | None = None
    max_queued: int | None = None
    share: float = 1.0
    max_priority: int = DEFAULT_MAX_PRIORITY

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_workers": self.max_workers,
            "max_queued": self.max_queued,
            "share": self.share,
            "max_priority": self.max_priority,
        }


def effective_max_priority(stored: int | None) -> int:
    """A user's max_priority: the stored one, or the default when none was set."""
    return DEFAULT_MAX_PRIORITY if stored is None else int(stored)


def quota_of(user: User) -> Quota:
    return Quota(
        user.max_workers,
        user.max_queued,
        float(user.share),
        effective_max_priority(user.max_priority),
    )


def max_priority_of(session: Session, user_id: int) -> int:
    """The highest priority this user may give a job (the default for an unknown id)."""
    stored = session.scalar(select(User.max_priority).where(User.id == user_id))
    return effective_max_priority(stored)


def set_quota(session: Session, user: User, changes: dict[str, Any]) -> Quota:
    """Apply the fields given (None removes a limit; a `share` of None goes back to 1, a
    `max_priority` of None to the default)."""
    for name, value in changes.items():
        if name not in QUOTA_FIELDS:
            raise KeyError(name)
        setattr(user, name, 1.0 if name == "share" and value is None else value)
    session.flush()
    return quota_of(user)


def project_quota_of(project: Project) -> dict[str, Any]:
    return {
        "max_workers": project.max_workers,
        "max_queued": project.max_queued,
        "share": float(project.share),
    }


def set_project_quota(
    session: Session, project: Project, changes: dict[str, Any]
) -> dict[str, Any]:
    """Apply the fields given to a project (None removes a limit; a `share` of None goes
    back to 1). A personal project's share is its user's: ValueError for one given."""
    for name, value in changes.items():
        if name not in PROJECT_QUOTA_FIELDS:
            raise KeyError(name)
        if name == "share" and value is not None and project.personal_of is not None:
            raise ValueError(
                f"{project.name} is a personal project: its share in fair share is its "
                "user's (PUT /v1/users/{name}/quota)"
            )
        setattr(project, name, 1.0 if name == "share" and value is None else value)
    session.flush()
    return project_quota_of(project)


class QueueFull(NamedTuple):
    """Why one more queued job is refused: the message, the limit, and the project whose
    limit it is (None: the user's)."""

    message: str
    limit: int
    project: str | None = None


def over_max_queued(
    session: Session, user_id: int, project_id: int | None = None
) -> QueueFull | None:
    """Why one more queued job of this user (in this project) is refused, or None when it
    may be stored: the user's max_queued first, then the project's.

    On PostgreSQL the user's row, then the project's (when it has a limit), is locked
    first, so two concurrent submits cannot both take the last place (on SQLite the
    writer's BEGIN IMMEDIATE serialises them already)."""
    q = select(User.name, User.max_queued).where(User.id == user_id)
    row = session.execute(q.with_for_update() if is_postgres(session) else q).first()
    if row is not None and row.max_queued is not None:
        queued = _queued(session, Job.owner_id == user_id)
        if queued >= row.max_queued:
            return QueueFull(
                f"{row.name} already has {queued} queued jobs, the quota's max_queued is "
                f"{row.max_queued}; wait for some to start or cancel some",
                row.max_queued,
            )
    if project_id is None:
        return None
    p = select(Project.name, Project.max_queued).where(Project.id == project_id)
    prow = session.execute(p).first()
    if prow is None or prow.max_queued is None:
        return None  # no lock: a team's submits without a limit do not queue up on its row
    if is_postgres(session):
        prow = session.execute(p.with_for_update()).first()
        if prow is None or prow.max_queued is None:
            return None
    queued = _queued(session, Job.project_id == project_id)
    if queued < prow.max_queued:
        return None
    return QueueFull(
        f"project {prow.name} already has {queued} queued jobs, its quota's max_queued is "
        f"{prow.max_queued}; wait for some to start or cancel some",
        prow.max_queued,
        prow.name,
    )


def _queued(session: Session, whose: ColumnElement[bool]) -> int:
    """Queued jobs, a sweep's paused trials left out: they were admitted with their sweep,
    and counting them could hold back the trials they wait for."""
    paused = Job.hold_until >= PAUSED_HOLD
    q = select(func.count()).select_from(Job).where(whose, Job.state == QUEUED)
    q = q.where(or_(Job.hold_until.is_(None), ~paused))
    return int(session.scalar(q) or 0)
