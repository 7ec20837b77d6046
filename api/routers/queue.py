"""The queue as the scheduler sees it: queued jobs in the order they would start (priority,
then fair share by project and user, then age: scheduler/cycle.py queue_order), each with
its project, and each user's usage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import responses
from torchyard.api.schemas import QueueCounts, QueueItem, QueueOut, QueueUsage, UserUsage
from torchyard.api.views import owner_reason
from torchyard.scheduler.cycle import QueueEntry, queue_order
from torchyard.scheduler.fairshare import FairShare
from torchyard.store.dialect import db_now
from torchyard.store.inventory import job_names, queued_by_owner, users_by_id
from torchyard.store.projects import visible_job_ids
from torchyard.store.quotas import quota_of
from torchyard.store.usage import usage_by_user

router = APIRouter(prefix="/v1/queue", tags=["pool"])

MAX_ITEMS = 1000
# Each user's first this many queued jobs are ordered: a non-admin's positions count every
# job ahead of theirs as long as no user has more than this many queued ahead of it.
PER_USER = 1000


@router.get(
    "",
    response_model=QueueOut,
    summary="Show the queue",
    description="Queued jobs in the order they would start: priority, then fair share "
    "(the projects, then the users, who used the pool least lately, per unit of share, "
    "first; a personal project counts as its user), then age, with each one's project, "
    "pending reason and its owner's usage (worker-hours decayed with the half-life, "
    "TORCHYARD_FAIRSHARE_HALF_LIFE_S). Admins see every job and every user with queued "
    "jobs; a user sees only their own jobs (with their positions in the whole queue), "
    "their own usage and quota, and pending reasons that name no other user's job, name or "
    "usage; `counts` covers the whole queue for both.",
    responses=responses(401, 422, 503),
)
def queue_route(
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=MAX_ITEMS, description="most jobs listed")] = 200,
) -> QueueOut:
    # An admin's first `limit` jobs are among each user's first `limit`: read no more.
    per_user = limit if user.is_admin else PER_USER
    entries, fs = queue_order(
        session, settings.fairshare_half_life_s, settings.heartbeat_timeout_s, per_user=per_user
    )
    counts = queued_by_owner(session)
    if user.is_admin:
        shown = entries
    else:  # the queued jobs of the caller's projects
        seen = set(visible_job_ids(session, user.id, (e.job.id for e in entries)))
        shown = [e for e in entries if e.job.id in seen]
    shown = shown[:limit]
    usage_s = {e.job.owner_id: e.usage_s for e in entries}
    owners = set(usage_s) if user.is_admin else {user.id}
    if user.id in owners and user.id not in usage_s:  # a user with nothing queued
        usage_s.update(
            usage_by_user(session, db_now(session), settings.fairshare_half_life_s, [user.id])
        )
    usage = _usage(session, owners, usage_s)
    return QueueOut(
        items=_items(session, shown, fs, full_reasons=user.is_admin),
        counts=QueueCounts(
            queued=sum(counts.values()), users=len(counts), mine=counts.get(user.id, 0)
        ),
        usage=usage,
        unit=fs.unit,
        half_life_s=fs.half_life_s,
    )


def _usage(session: Session, owners: set[int], usage_s: dict[int, float]) -> dict[str, UserUsage]:
    """Each owner's usage and quota, by name."""
    out = {}
    for uid, u in sorted(users_by_id(session, owners).items()):
        q = quota_of(u)
        out[u.name] = UserUsage(
            worker_hours=usage_s.get(uid, 0.0) / 3600,
            share=q.share,
            max_workers=q.max_workers,
            max_queued=q.max_queued,
        )
    return out


def _items(
    session: Session, shown: list[QueueEntry], fs: FairShare, full_reasons: bool
) -> list[QueueItem]:
    """The listed jobs; without `full_reasons` (a non-admin) their pending reasons name no
    other user's job, name or usage (api/views.py: owner_reason)."""
    names = job_names(session, [e.job.id for e in shown])
    projects = {p.id: p.name for p in fs.projects.values()}  # read by queue_order already
    return [
        QueueItem(
            position=e.position,
            id=e.job.id,
            name=names.get(e.job.id, ""),
            owner=e.owner,
            project=projects.get(e.job.project_id or 0),
            priority=e.job.priority,
            world_size=e.job.world_size,
            pending_reason=e.job.pending_reason
            if full_reasons
            else owner_reason(e.job.pending_reason, e.job.id, e.owner),
            created_at=e.job.created_at,
            usage=QueueUsage(worker_hours=e.usage_s / 3600, share=_share(fs, e.job.owner_id)),
        )
        for e in shown
    ]


def _share(fs: FairShare, uid: int) -> float:
    u = fs.users.get(uid)
    return u.share if u is not None else 1.0
