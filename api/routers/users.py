"""Users: their permissions (admins give and take them back: `PATCH /v1/users/{name}`),
their quotas, their limits in the shared pool (store/quotas.py says what each does), and
the link of a user to their single sign-on account (store/sso.py).

A permission is the user's, not a token's: a change holds for every token and dashboard
session of the user from the next request on in this API process (their token cache
entries are dropped), and at once on admins-only routes in every process (api/deps.py
reads the admin flag afresh there); other routes of another API process see it within the
token cache's few seconds, as a revocation."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Body, Path, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import (
    AdminUser,
    CurrentUser,
    Principal,
    ReadSessionDep,
    SettingsDep,
    TokenCache,
    actor_of,
)
from torchyard.api.errors import ApiError, not_found, responses
from torchyard.api.schemas import QuotaIn, QuotaOut
from torchyard.broker import app as broker
from torchyard.store.audit import Actor, changed, record
from torchyard.store.auth import LastAdmin, permissions_of, set_permissions, user_named
from torchyard.store.models import User
from torchyard.store.quotas import quota_of, set_quota
from torchyard.store.sso import IdentityTaken, link_identity

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


class PermissionsIn(BaseModel):
    """The permissions to change; absent (or null): unchanged."""

    model_config = ConfigDict(extra="forbid")

    admin: StrictBool | None = Field(default=None, description="the user is an admin")
    can_run_code: StrictBool | None = Field(
        default=None, description="the user's jobs may run their own code"
    )


class PermissionsOut(BaseModel):
    user: str
    admin: bool
    can_run_code: bool


def _store_permissions(
    factory: sessionmaker[Session], name: str, body: PermissionsIn, actor: Actor
) -> tuple[int, PermissionsOut]:
    with factory() as session:
        found = user_named(session, name)
        if found is None:
            raise not_found(f"user {name!r}")
        before = permissions_of(found)
        try:
            after = set_permissions(session, found, body.admin, body.can_run_code)
        except LastAdmin as e:
            raise ApiError(409, str(e), code="conflict") from None
        details = changed(before, after)
        if details is not None:
            record(session, actor, "user.grant", f"user:{name}", details)
        session.commit()
        return found.id, PermissionsOut(user=name, **after)


@router.patch(
    "/{name}",
    response_model=PermissionsOut,
    summary="Give or take back a user's permissions (admins)",
    description="`admin` and `can_run_code` (true or false; absent: unchanged) are the "
    "user's, so they hold for every token and dashboard session of the user, the ones made "
    "before included, from the next request on; revoking the token that granted one takes "
    "nothing away, this does. Answers with both. A change is in the audit trail "
    "(`user.grant`, before and after). Taking admin from the last admin is 409; an unknown "
    "user 404, an unknown field 422.",
    responses=responses(401, 403, 404, 409, 422, 503),
)
async def patch_user_route(
    name: UserName, body: Annotated[PermissionsIn, Body()], request: Request, user: AdminUser
) -> PermissionsOut:
    target, actor = _target(user, name), actor_of(request, user)
    user_id, out = await run_in_threadpool(
        _store_permissions, request.app.state.sessions, target, body, actor
    )
    # After the commit: a lookup under way now may have read the user before it.
    cache: TokenCache = request.app.state.token_cache
    cache.drop_user(user_id)
    return out


class IdentityIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    subject: str = Field(
        min_length=1,
        max_length=255,
        description="the account's `sub` at the configured OpenID provider (a refused "
        "first sign-in names it)",
    )


class IdentityOut(BaseModel):
    user: str
    issuer: str
    subject: str


def _store_link(
    factory: sessionmaker[Session], name: str, issuer: str, subject: str, actor: Actor
) -> IdentityOut:
    with factory() as session:
        found = user_named(session, name)
        if found is None:
            raise not_found(f"user {name!r}")
        try:
            before = link_identity(session, found, issuer, subject)
        except IdentityTaken as e:
            raise ApiError(409, str(e), code="conflict") from None
        if before != subject:
            record(session, actor, "user.link", f"user:{name}",
                   {"issuer": issuer, "subject": subject, "before": before})  # fmt: skip
        session.commit()
        return IdentityOut(user=name, issuer=issuer, subject=subject)


@router.put(
    "/{name}/identity",
    response_model=IdentityOut,
    summary="Link a user to their single sign-on account (admins)",
    description="From then on the provider account (the configured issuer and this `sub`) "
    "signs in as the user, whatever name the provider gives. Single sign-on never takes "
    "over an existing user by name: a first sign-in under the name of a user not linked to "
    "that account is refused, and the refusal names the `sub` to link here once you know "
    "the account is that user's. A link the user had to another account of the provider "
    "is replaced; an account linked to another user is 409. In the audit trail "
    "(`user.link`). 404 without single sign-on.",
    responses=responses(401, 403, 404, 409, 422, 503),
)
async def link_identity_route(
    name: UserName,
    body: Annotated[IdentityIn, Body()],
    request: Request,
    user: AdminUser,
    settings: SettingsDep,
) -> IdentityOut:
    if not settings.sso_enabled or settings.oidc_issuer is None:
        raise ApiError(404, "single sign-on is not configured on this server", code="sso_off")
    target, actor = _target(user, name), actor_of(request, user)
    return await run_in_threadpool(
        _store_link, request.app.state.sessions, target, settings.oidc_issuer, body.subject, actor
    )
