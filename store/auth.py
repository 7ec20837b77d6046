"""API tokens: created once in plaintext, stored only as a sha256 hash.

A token is `ty_` + 43 url-safe characters (256 random bits); its hash is the lookup
key, so a stolen database yields no usable token.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from torchyard.store.models import ApiToken, User

TOKEN_PREFIX = "ty_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def get_or_create_user(
    session: Session, user_name: str, admin: bool = False, can_run_code: bool = False
) -> User:
    """The user called `user_name`, created if missing. `admin=True` and `can_run_code=True`
    promote an existing user; False never demotes one (a new token must not silently take
    away what an earlier one was given)."""
    user = session.scalar(select(User).where(User.name == user_name))
    if user is None:
        user = User(name=user_name, is_admin=admin, can_run_code=can_run_code)
        session.add(user)
        session.flush()
        return user
    if admin and not user.is_admin:
        user.is_admin = True
    if can_run_code and not user.can_run_code:
        user.can_run_code = True
    return user


def user_named(session: Session, user_name: str) -> User | None:
    return session.scalar(select(User).where(User.name == user_name))


def create_token(
    session: Session, user_name: str, admin: bool = False, can_run_code: bool = False
) -> str:
    """Create a token for `user_name` (creating the user if missing); returns the plaintext.
    `can_run_code`: the user's jobs may run their own code (see get_or_create_user)."""
    if not user_name or len(user_name) > 100:
        raise ValueError("user name must be 1 to 100 characters")
    user = get_or_create_user(session, user_name, admin, can_run_code)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(user_id=user.id, token_hash=hash_token(token), prefix=token[:10]))
    session.flush()
    return token


def user_for_token(session: Session, token: str) -> User | None:
    """The user a live (unrevoked) token belongs to, or None."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    return session.scalar(
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    )
