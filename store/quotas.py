"""Per-user limits of the shared pool (set by an admin: PUT /v1/users/{name}/quota).

- `max_queued`: a submit (or a sweep's next trial) while the user already has that many
  queued jobs is refused (the API answers 429);
- `max_workers`: the scheduler starts none of the user's jobs that would take them past
  that many workers (the job waits, its pending reason names the limit);
- `share`: the weight of the user's fair share (usage is divided by it).
`None` means no limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres
from torchyard.store.models import Job, User
from torchyard.store.states import QUEUED

QUOTA_FIELDS = ("max_workers", "max_queued", "share")


@dataclass(frozen=True)
class Quota:
    max_workers: int | None = None
    max_queued: int | None = None
    share: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"max_workers": self.max_workers, "max_queued": self.max_queued, "share": self.share}


def quota_of(user: User) -> Quota:
    return Quota(user.max_workers, user.max_queued, float(user.share))


def set_quota(session: Session, user: User, changes: dict[str, Any]) -> Quota:
    """Apply the fields given (None removes a limit; a `share` of None goes back to 1)."""
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
