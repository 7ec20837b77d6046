"""Users' quotas: their limits in the shared pool (store/quotas.py says what each does)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Path, Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import (
    AdminUser,
    CurrentUser,
    Principal,
    ReadSessionDep,
    SettingsDep,
    actor_of,
)
from torchyard.api.errors import ApiError, not_found, responses
from torchyard.api.schemas import QuotaIn, QuotaOut
from torchyard.broker import app as broker
from torchyard.store.audit import Actor, changed, record
from torchyard.store.auth import user_named
from torchyard.store.models import User
from torchyard.store.quotas import quota_of, set_quota

router = APIRouter(prefix="/v1/users", tags=["users"])

ME = "me"
UserName = Annotated[
    str,
    Path(
        min_length=1,
        max_length=100,
        description=f"a user name; `{ME}` is always the caller (whatever their name)",
    ),
]


def _target(user: Principal, name: str) -> str:
    return user.name if name == ME else name


def _quota_out(user: User) -> QuotaOut:
    return QuotaOut(user=user.name, **quota_of(user).as_dict())


@router.get(
    "/{name}/quota",
    response_model=QuotaOut,
    summary="Show a user's quota",
    description="`max_workers`, `max_queued` (null: no limit), the fair-share `share` and "
    "`max_priority` (the highest priority the user may give a job; default 0). "
    "Any user may read their own (`/v1/users/me/quota`); only admins another's (403).",
    responses=responses(401, 403, 404, 422, 503),
)
def get_quota_route(name: UserName, user: CurrentUser, session: ReadSessionDep) -> QuotaOut:
    target = _target(user, name)
    if target != user.name and not user.is_admin:
        raise ApiError(403, "only admins may see another user's quota", code="forbidden")
    found = user_named(session, target)
    if found is None:
        raise not_found(f"user {target!r}")
    return _quota_out(found)


def _store_quota(
    factory: sessionmaker[Session], name: str, changes: dict[str, Any], actor: Actor
) -> QuotaOut:
    with factory() as session:
        found = user_named(session, name)
        if found is None:
            raise not_found(f"user {name!r}")
        before = quota_of(found).as_dict()
        after = set_quota(session, found, changes).as_dict()
        details = changed(before, after)
        if details is not None:  # fields set to the values they had are no change
            record(session, actor, "user.quota", f"user:{name}", details)
        session.commit()
        return _quota_out(found)


@router.put(
    "/{name}/quota",
    response_model=QuotaOut,
    summary="Set a user's quota (admins)",
    description="Changes the fields given and answers with the whole quota. "
    "`max_workers`: the scheduler starts none of the user's jobs that would take them past "
    "that many workers (the job waits, its pending reason says why); `max_queued`: a submit "
    "while the user has that many queued jobs is 429; both are integers >= 0 (0: no job "
    "starts, or none may be submitted), null removes the limit. `share` (> 0; null: back to "
    "1) weighs the user's fair share: usage is divided by it. `max_priority` (-1000 to "
    "1000; null: back to the default, 0) is the highest priority the user may give a job "
    "(a submit or sweep above it is 403; admins are not limited), and protects the user's "
    "running jobs: another user's job preempts them only with a priority above it. So by "
    "default a user orders their own jobs and preempts nobody else's. Unknown fields are 422.",
    responses=responses(401, 403, 404, 422, 503),
)
async def put_quota_route(
    name: UserName,
    body: QuotaIn,
    request: Request,
    user: AdminUser,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> QuotaOut:
    changes = body.model_dump(include=body.model_fields_set)
    target, actor = _target(user, name), actor_of(request, user)
    quota = await run_in_threadpool(
        _store_quota, request.app.state.sessions, target, changes, actor
    )
    if changes:  # a raised max_workers, share or max_priority may let a waiting job start
        background.add_task(broker.wake_scheduler, settings)
    return quota
