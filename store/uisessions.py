"""The dashboard's logins: one-time login links and sessions.

`torchyard ui` asks for a login link (an authenticated call): a secret valid for
LINK_TTL_S that the page exchanges, once, for a session. Typing a token on the login page
makes a session too. Both are stored as the sha256 of their secret (a stolen database
yields no usable one) and belong to the API token that made them: a session acts as that
token and ends when it is revoked or after SESSION_TTL_S. The session's CSRF token is
derived from its secret, so nothing else is stored.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from torchyard.store.auth import TOKEN_PREFIX, hash_token
from torchyard.store.models import ApiToken, UiLoginLink, UiSession, User, utcnow

LINK_TTL_S = 300.0
SESSION_TTL_S = 12 * 3600.0
LINK_PREFIX = "tyl_"
SESSION_PREFIX = "tys_"


def _new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def csrf_token(session_secret: str) -> str:
    """The CSRF token of a session: only someone who holds the (HttpOnly) cookie, or was
    told by the server, can know it."""
    return hashlib.sha256(b"torchyard-csrf\0" + session_secret.encode()).hexdigest()


def token_id_for(session: Session, token: str) -> int | None:
    """The id of a live API token, or None."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    return session.scalar(
        select(ApiToken.id).where(
            ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None)
        )
    )


def _purge(session: Session) -> None:
    now = utcnow()
    session.execute(delete(UiLoginLink).where(UiLoginLink.expires_at < now))
    session.execute(delete(UiSession).where(UiSession.expires_at < now))


def _store_secret(
    session: Session, model: type[UiLoginLink | UiSession], prefix: str, token_id: int, ttl_s: float
) -> str:
    """A new secret of `model` for the token, stored hashed; returns its plaintext."""
    _purge(session)
    secret = _new_secret(prefix)
    now = utcnow()
    expires = now + timedelta(seconds=ttl_s)
    session.add(model(secret_hash=hash_token(secret), token_id=token_id, created_at=now, expires_at=expires))  # fmt: skip
    session.flush()
    return secret


def create_login_link(session: Session, token_id: int, ttl_s: float = LINK_TTL_S) -> str:
    """A one-time login secret for the token's user; returns its plaintext (kept nowhere)."""
    return _store_secret(session, UiLoginLink, LINK_PREFIX, token_id, ttl_s)


def redeem_login_link(session: Session, secret: str) -> int | None:
    """Use a login secret (once, before it expires, while its token is live): its token's
    id, or None. One conditional UPDATE, so two exchanges of one secret cannot both win."""
    if not secret.startswith(LINK_PREFIX) or len(secret) > 200:
        return None
    now = utcnow()
    live_token = select(ApiToken.id).where(
        ApiToken.id == UiLoginLink.token_id, ApiToken.revoked_at.is_(None)
    )
    token_id = session.execute(
        update(UiLoginLink)
        .where(
            UiLoginLink.secret_hash == hash_token(secret),
            UiLoginLink.used_at.is_(None),
            UiLoginLink.expires_at > now,
            live_token.exists(),
        )
        .values(used_at=now)
        .returning(UiLoginLink.token_id)
    ).scalar()
    return None if token_id is None else int(token_id)


def create_session(session: Session, token_id: int, ttl_s: float = SESSION_TTL_S) -> str:
    """A dashboard session acting as the token; returns its secret (the cookie's value)."""
    return _store_secret(session, UiSession, SESSION_PREFIX, token_id, ttl_s)


def user_for_session(session: Session, secret: str) -> User | None:
    """The user of a live session (unexpired, its token unrevoked), or None."""
    if not secret.startswith(SESSION_PREFIX) or len(secret) > 200:
        return None
    return session.scalar(
        select(User)
        .join(ApiToken, ApiToken.user_id == User.id)
        .join(UiSession, UiSession.token_id == ApiToken.id)
        .where(
            UiSession.secret_hash == hash_token(secret),
            UiSession.expires_at > utcnow(),
            ApiToken.revoked_at.is_(None),
        )
    )


def end_session(session: Session, secret: str) -> None:
    session.execute(delete(UiSession).where(UiSession.secret_hash == hash_token(secret)))
