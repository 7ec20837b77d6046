"""API tokens: created once in plaintext, stored only as a sha256 hash; listed (never the
secret) and revoked.

A token is `ty_` + 43 url-safe characters (256 random bits); its hash is the lookup
key, so a stolen database yields no usable token. Revoking one also ends the dashboard
sessions and login links made from it, and tells what the API's token cache must forget
(api/routers/tokens.py), so a revoked token is refused at once.

A user's `admin` and `can_run_code` are the user's, never a token's: a token made with one
grants it to the user, and only `set_permissions` (PATCH /v1/users/{name}) takes it back.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from torchyard.store.models import ApiToken, UiLoginLink, UiSession, User, utcnow
from torchyard.store.projects import ensure_personal

TOKEN_PREFIX = "ty_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def get_or_create_user(
    session: Session, user_name: str, admin: bool = False, can_run_code: bool = False
) -> User:
    """The user called `user_name`, created (with their personal project) if missing. `admin=True` and `can_run_code=True`
    promote an existing user; False never demotes one (a new token must not silently take
    away what an earlier one was given)."""
    user = session.scalar(select(User).where(User.name == user_name))
    if user is None:
        user = User(name=user_name, is_admin=admin, can_run_code=can_run_code)
        session.add(user)
        session.flush()
        ensure_personal(session, user)
        return user
    if admin and not user.is_admin:
        user.is_admin = True
    if can_run_code and not user.can_run_code:
        user.can_run_code = True
    return user


def user_named(session: Session, user_name: str) -> User | None:
    return session.scalar(select(User).where(User.name == user_name))


class LastAdmin(Exception):
    """Taking `admin` from the only admin left (nobody could give it back over the API)."""


def permissions_of(user: User) -> dict[str, bool]:
    return {"admin": user.is_admin, "can_run_code": user.can_run_code}


def set_permissions(
    session: Session, user: User, admin: bool | None, can_run_code: bool | None
) -> dict[str, bool]:
    """Set the permissions given (None: unchanged) and return them all: `PATCH
    /v1/users/{name}`, the one way to take one back (they are the user's, so revoking the
    token that granted one takes nothing). LastAdmin, nothing changed, when `user` is the
    last admin and `admin` is False. The caller commits."""
    if admin is False and user.is_admin:
        # Every admin row locked (PostgreSQL): two admins demoting each other at once
        # cannot both still see the other one an admin. SQLite's writers are serialised.
        admins = session.scalars(select(User.id).where(User.is_admin).with_for_update()).all()
        if set(admins) <= {user.id}:
            raise LastAdmin(
                f"{user.name!r} is the last admin: make another user an admin first "
                "(nobody could give admin back over the API)"
            )
    if admin is not None:
        user.is_admin = admin
    if can_run_code is not None:
        user.can_run_code = can_run_code
    session.flush()
    return permissions_of(user)


def create_token(
    session: Session,
    user_name: str,
    admin: bool = False,
    can_run_code: bool = False,
    label: str | None = None,
) -> str:
    """Create a token for `user_name` (creating the user if missing); returns the plaintext.
    `can_run_code`: the user's jobs may run their own code (see get_or_create_user)."""
    return issue_token(session, user_name, admin, can_run_code, label)[1]


def issue_token(
    session: Session,
    user_name: str,
    admin: bool = False,
    can_run_code: bool = False,
    label: str | None = None,
) -> tuple[ApiToken, str]:
    """`create_token`, returning the new row too (its id, prefix and time)."""
    if not user_name or len(user_name) > 100:
        raise ValueError("user name must be 1 to 100 characters")
    if label is not None and len(label) > 100:
        raise ValueError("a token's label is at most 100 characters")
    user = get_or_create_user(session, user_name, admin, can_run_code)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:10], label=label)
    session.add(row)
    session.flush()
    return row, token


@dataclass(frozen=True)
class TokenInfo:
    """A live token as it is listed: never its secret or hash."""

    id: int
    user: str
    label: str | None
    prefix: str
    created_at: datetime


def list_tokens(session: Session, user_id: int | None) -> list[TokenInfo]:
    """The live tokens of `user_id` (None: everyone's), oldest first."""
    q = (
        select(ApiToken.id, User.name, ApiToken.label, ApiToken.prefix, ApiToken.created_at)
        .join(User, User.id == ApiToken.user_id)
        .where(ApiToken.revoked_at.is_(None))
        .order_by(ApiToken.id)
    )
    if user_id is not None:
        q = q.where(ApiToken.user_id == user_id)
    return [TokenInfo(*row) for row in session.execute(q)]


def revoke_token(
    session: Session, token_id: int, user_id: int | None
) -> tuple[str, list[str]] | None:
    """Revoke the token `token_id` of `user_id` (None: anyone's, for an admin) and end the
    dashboard sessions and login links made from it. Returns the hashes of the token and of
    those sessions' secrets (what the API's token cache knows them by), or None when there
    is no such token the caller may see. Revoking a revoked token again changes nothing."""
    q = select(ApiToken.token_hash).where(ApiToken.id == token_id)
    if user_id is not None:
        q = q.where(ApiToken.user_id == user_id)
    token_hash = session.scalar(q)
    if token_hash is None:
        return None
    session.execute(
        update(ApiToken)
        .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    ended = select(UiSession.secret_hash).where(UiSession.token_id == token_id)
    sessions = list(session.scalars(ended))
    session.execute(delete(UiSession).where(UiSession.token_id == token_id))
    session.execute(delete(UiLoginLink).where(UiLoginLink.token_id == token_id))
    return token_hash, sessions


def user_for_token(session: Session, token: str) -> User | None:
    """The user a live (unrevoked) token belongs to, or None."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    return session.scalar(
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    )
