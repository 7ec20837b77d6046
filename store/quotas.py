"""Per-user limits of the shared pool (set by an admin: PUT /v1/users/{name}/quota).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres
from torchyard.store.models import Job, User
from torchyard.store.states import QUEUED

QUOTA_FIELDS = ("max_workers", "max_queued", "share", "max_priority")
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


def over_max_queued(session: Session, user_id: int) -> str | None:
    """Why one more queued job of this user is refused, or None when it may be stored.

    On PostgreSQL the user's row is locked first, so two concurrent submits cannot both
    take the last place (on SQLite the writer's BEGIN IMMEDIATE serialises them already)."""
    q = select(User.name, User.max_queued).where(User.id == user_id)
    if is_postgres(session):
        q = q.with_for_update()
    row = session.execute(q).first()
    if row is None or row.max_queued is None:
        return None
    queued = session.scalar(
        select(func.count()).select_from(Job).where(Job.owner_id == user_id, Job.state == QUEUED)
    )
    if int(queued or 0) < row.max_queued:
        return None
    return (
        f"{row.name} already has {queued} queued jobs, the quota's max_queued is "
        f"{row.max_queued}; wait for some to start or cancel some"
    )
