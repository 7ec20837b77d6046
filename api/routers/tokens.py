"""API tokens over the API: list (your own; admins everyone's), create (admins: the secret
is shown once, in the answer), revoke (your own, or anyone's for an admin).

A listed token shows its id, owner, label, the first characters of its secret (`ty_…`, to
tell it apart from the one in your config) and when it was made, never the secret or its
hash. Someone else's token is a 404 for a non-admin, as a missing one is: ids tell nothing.
A revocation takes effect at once in this API process: the token, and the dashboard
sessions made from it, are dropped from the token cache (api/deps.py) in the same request.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Body, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import AdminUser, CurrentUser, ReadSessionDep, TokenCache, actor_of
from torchyard.api.errors import not_found, responses
from torchyard.store.audit import Actor, changed, record
from torchyard.store.auth import TokenInfo, issue_token, list_tokens, revoke_token, user_named
from torchyard.store.models import ApiToken, User

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])

# Printable names only: a user name is shown in tables, reasons and logs.
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")
NO_STORE = {"Cache-Control": "no-store"}


class TokenOut(BaseModel):
    id: int
    user: str = Field(description="the token's owner")
    label: str | None = Field(description="what its owner calls it")
    prefix: str = Field(description="the secret's first characters, to recognise it by")
    created_at: datetime


class TokenList(BaseModel):
    items: list[TokenOut] = Field(description="live tokens, oldest first")
    next_cursor: str | None = None


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str = Field(
        min_length=1, max_length=100, description="the owner (created if there is none)"
    )
    label: str | None = Field(
        default=None, min_length=1, max_length=100, description="a name for the token"
    )
    admin: bool = Field(default=False, description="make the user an admin (never demotes)")
    can_run_code: bool = Field(
        default=False,
        description="the user's jobs may run their own code (never takes it away)",
    )

    @field_validator("user", "label")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and not _PRINTABLE.match(v):
            raise ValueError("must not contain control characters")
        return v


class TokenCreated(TokenOut):
    token: str = Field(description="the secret: shown this once, kept nowhere in plaintext")


def _out(info: TokenInfo) -> TokenOut:
    return TokenOut(
        id=info.id, user=info.user, label=info.label, prefix=info.prefix, created_at=info.created_at
    )


@router.get(
    "",
    response_model=TokenList,
    summary="List API tokens",
    description="Your live tokens; an admin sees every user's (with `user`). Never a "
    "secret: `prefix` is its first characters.",
    responses=responses(401, 503),
)
def list_tokens_route(user: CurrentUser, session: ReadSessionDep, response: Response) -> TokenList:
    response.headers.update(NO_STORE)
    rows = list_tokens(session, None if user.is_admin else user.id)
    return TokenList(items=[_out(r) for r in rows], next_cursor=None)


def _create(factory: sessionmaker[Session], body: TokenIn, actor: Actor) -> TokenCreated:
    with factory() as session:
        before = _grants(user_named(session, body.user))
        row, secret = issue_token(session, body.user, body.admin, body.can_run_code, body.label)
        _record_create(session, actor, body, row.id, before)
        session.commit()
        return TokenCreated(
            id=row.id,
            user=body.user,
            label=row.label,
            prefix=row.prefix,
            created_at=row.created_at,
            token=secret,
        )


def _grants(user: User | None) -> dict[str, bool] | None:
    return None if user is None else {"admin": user.is_admin, "can_run_code": user.can_run_code}


def _record_create(
    session: Session, actor: Actor, body: TokenIn, token_id: int, before: dict[str, bool] | None
) -> None:
    """The audit entries of a token made (never its secret) and of what it granted its
    user: `user.create` for a new user, `user.grant` for a raised permission."""
    details = body.model_dump(include={"user", "admin", "can_run_code", "label"})
    record(session, actor, "token.create", f"token:{token_id}", details)
    after = _grants(user_named(session, body.user)) or {}
    if before is None:
        record(session, actor, "user.create", f"user:{body.user}", after)
    elif (grant := changed(before, after)) is not None:
        record(session, actor, "user.grant", f"user:{body.user}", grant)


@router.post(
    "",
    status_code=201,
    response_model=TokenCreated,
    summary="Create an API token (admins)",
    description="A new token for `user`, who is created if missing; `admin` and "
    "`can_run_code` grant those permissions (they never take one away). The secret is in "
    "this answer only.",
    responses=responses(401, 403, 422, 503),
)
async def create_token_route(
    request: Request, user: AdminUser, body: Annotated[TokenIn, Body()], response: Response
) -> TokenCreated:
    response.headers.update(NO_STORE)  # the caller is an admin: checked before the body
    actor = actor_of(request, user)
    return await run_in_threadpool(_create, request.app.state.sessions, body, actor)


def _revoke(
    factory: sessionmaker[Session], token_id: int, owner: int | None, actor: Actor
) -> tuple[str, list[str]] | None:
    with factory() as session:
        live = session.execute(
            select(User.name, ApiToken.label)
            .join(User, User.id == ApiToken.user_id)
            .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
        ).first()
        revoked = revoke_token(session, token_id, owner)
        if revoked is not None and live is not None:  # revoking again changes nothing
            details = {"user": live.name, "label": live.label}
            record(session, actor, "token.revoke", f"token:{token_id}", details)
        session.commit()
        return revoked


@router.delete(
    "/{token_id}",
    status_code=204,
    summary="Revoke an API token",
    description="Your own token, or anyone's for an admin; it is refused from the next "
    "request on, and the dashboard sessions made from it end. Someone else's token is 404, "
    "as a missing one; revoking a revoked token again is 204.",
    responses=responses(401, 404, 422, 503),
)
async def revoke_token_route(
    request: Request, user: CurrentUser, token_id: Annotated[int, Path(ge=1, le=2**31 - 1)]
) -> Response:
    owner = None if user.is_admin else user.id
    actor = actor_of(request, user)
    revoked = await run_in_threadpool(_revoke, request.app.state.sessions, token_id, owner, actor)
    if revoked is None:
        raise not_found("token")
    token_hash, sessions = revoked
    cache: TokenCache = request.app.state.token_cache
    cache.drop(token_hash)
    for secret_hash in sessions:
        cache.drop("session:" + secret_hash)
    return Response(status_code=204)
