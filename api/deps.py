"""What routes get injected: settings, a database session, and the authenticated user.

Tokens are looked up by their hash; a hit is cached in the process for a few seconds
(TOKEN_CACHE_TTL_S), so the hot read routes cost no token query. A token revoked
through this process (DELETE /v1/tokens/{id}) is dropped from its cache at once; in other
API processes it may keep working for up to TOKEN_CACHE_TTL_S; an event stream opened
with it asks again every few seconds (`still_authorized`, api/streams.py) and ends. The requests that miss
while a lookup is under way share it: when a busy client's entry expires, its dozens of
requests in flight make one query, not one each queued for the few store threads (that
queue was the API's tail latency every TTL, bench/api_bench.py).

The dashboard authenticates with a session cookie instead (store/uisessions.py), which
acts as the token that made it; without an Authorization header the cookie is looked up
the same way. A request that changes something (not GET/HEAD/OPTIONS) with the cookie must
also carry the session's CSRF token in X-CSRF-Token: another site can make the browser send
the cookie (SameSite=Strict already stops that in current browsers) but cannot know it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.errors import ApiError
from torchyard.settings import Settings
from torchyard.store.audit import Actor
from torchyard.store.auth import hash_token, user_for_token
from torchyard.store.jobs import Viewer
from torchyard.store.models import User
from torchyard.store.uisessions import csrf_token, user_for_session

TOKEN_CACHE_TTL_S = 5.0
TOKEN_CACHE_MAX = 10_000
SESSION_COOKIE = "ty_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Principal:
    id: int
    name: str
    is_admin: bool
    # May submit jobs that run their own code (store: users.can_run_code).
    can_run_code: bool = False

    @property
    def viewer(self) -> Viewer:
        return Viewer(self.id, self.is_admin)


class TokenCache:
    """Positive lookups only (an unknown token always reaches the database), bounded; one
    lookup at a time per token (`fetch`)."""

    def __init__(self, ttl_s: float = TOKEN_CACHE_TTL_S, max_entries: int = TOKEN_CACHE_MAX):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._pending: dict[str, asyncio.Task[Principal | None]] = {}

    async def fetch(
        self, token_hash: str, load: Callable[[], Awaitable[Principal | None]]
    ) -> Principal | None:
        """The cached principal, else the result of one `load` shared by every caller that
        misses until it ends (its error too: the store is down for all of them). The load
        runs as its own task, so a caller that goes away (client disconnect) does not cancel
        it for the others; a caller on another event loop (tests' portals) loads its own."""
        hit = self.get(token_hash)
        if hit is not None:
            return hit
        task = self._pending.get(token_hash)
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = asyncio.ensure_future(self._load(token_hash, load))
            task.add_done_callback(_retrieve)
            self._pending[token_hash] = task
        return await asyncio.shield(task)

    async def _load(
        self, token_hash: str, load: Callable[[], Awaitable[Principal | None]]
    ) -> Principal | None:
        try:
            principal = await load()
        except BaseException:
            self._settle(token_hash)
            raise
        # Cached only if nothing dropped the token meanwhile (a logout during the lookup).
        if self._settle(token_hash) and principal is not None:
            self.put(token_hash, principal)
        return principal

    def _settle(self, token_hash: str) -> bool:
        """Ends the running task's lookup; False if `drop` or `clear` came first."""
        if self._pending.get(token_hash) is not asyncio.current_task():
            return False
        del self._pending[token_hash]
        return True

    def get(self, token_hash: str) -> Principal | None:
        hit = self._entries.get(token_hash)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, token_hash: str, principal: Principal) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[token_hash] = (time.monotonic() + self.ttl_s, principal)

    def drop(self, token_hash: str) -> None:
        self._entries.pop(token_hash, None)
        self._pending.pop(token_hash, None)

    def drop_user(self, user_id: int) -> None:
        """Forget every credential of `user_id` (their permissions changed), and every
        lookup under way: one that read the user before the change must not cache it."""
        for key in [k for k, (_, p) in self._entries.items() if p.id == user_id]:
            del self._entries[key]
        self._pending.clear()

    def clear(self) -> None:
        self._entries.clear()
        self._pending.clear()


def _retrieve(task: asyncio.Task[Principal | None]) -> None:
    """Marks a shared lookup's error as seen: its waiters may all have gone away."""
    if not task.cancelled():
        task.exception()


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _open(factory: sessionmaker[Session]) -> Iterator[Session]:
    session = factory()
    try:
        yield session
    finally:
        session.close()


def get_session(request: Request) -> Iterator[Session]:
    """A session for a route that writes; nothing is committed unless the route commits."""
    yield from _open(request.app.state.sessions)


def get_read_session(request: Request) -> Iterator[Session]:
    """A session for a route that only reads: it never takes SQLite's write lock."""
    yield from _open(request.app.state.read_sessions)


def read_engine(request: Request) -> Engine:
    """The read sessions' engine, for a hot route that runs one or two statements on a
    bare connection (same isolation as a read session, without the Session's cost)."""
    engine: Engine = request.app.state.read_sessions.kw["bind"]
    return engine


def _lookup(factory: sessionmaker[Session], token: str, cookie: bool = False) -> Principal | None:
    with factory() as session:
        user = user_for_session(session, token) if cookie else user_for_token(session, token)
        if user is None:
            return None
        return Principal(user.id, user.name, user.is_admin, user.can_run_code)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


async def _principal(request: Request, secret: str, cookie: bool) -> Principal | None:
    key = ("session:" if cookie else "") + hash_token(secret)
    cache: TokenCache = request.app.state.token_cache
    factory = request.app.state.read_sessions
    return await cache.fetch(key, lambda: run_in_threadpool(_lookup, factory, secret, cookie))


class BearerAuth(HTTPBearer):
    """The API's security scheme (HTTP bearer in the OpenAPI document) and its check in one
    dependency: FastAPI solves every dependency's parameters on every request, and with the
    scheme as a separate sub-dependency that was a tenth of a job poll's CPU
    (bench/api_bench.py). The header is read as HTTPBearer reads it; without a bearer token
    the dashboard's session cookie is tried."""

    async def __call__(self, request: Request) -> Principal:  # type: ignore[override]
        scheme, token = get_authorization_scheme_param(request.headers.get("Authorization"))
        if token and scheme.lower() == "bearer":
            principal = await _principal(request, token, cookie=False)
            if principal is None:
                raise _unauthorized("unknown or revoked token")
            request.state.credential = (token, False)
            return principal
        session = request.cookies.get(SESSION_COOKIE)
        if not session:
            raise _unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), csrf_token(session).encode()):
                raise ApiError(403, f"missing or wrong {CSRF_HEADER} header", code="csrf")
        principal = await _principal(request, session, cookie=True)
        if principal is None:
            raise _unauthorized("the dashboard session has ended: log in again")
        request.state.credential = (session, True)
        return principal


async def still_authorized(request: Request, user: Principal) -> bool:
    """Whether the credential this request was let in with (its bearer token or dashboard
    session) still stands for `user`: a long-lived response (an event stream) asks every few
    seconds. Through the token cache, so it costs a store query per credential per
    TOKEN_CACHE_TTL_S at most (a revoked token is seen within that; a logout drops its entry
    at once). A store that cannot answer ends nothing (it cannot have recorded a revocation
    the cache has not seen either)."""
    credential = getattr(request.state, "credential", None)
    if credential is None:
        return True  # not let in by a credential of ours (a test's override)
    secret, cookie = credential
    try:
        principal = await _principal(request, secret, cookie)
    except Exception:
        return True
    return principal is not None and principal.id == user.id


current_user = BearerAuth(
    scheme_name="HTTPBearer",
    auto_error=False,
    description="an API token from `torchyard token create --user NAME`",
)


def _is_admin_now(factory: sessionmaker[Session], user_id: int) -> bool:
    with factory() as session:
        return bool(session.scalar(select(User.is_admin).where(User.id == user_id)))


async def admin_user(
    request: Request, user: Annotated[Principal, Depends(current_user)]
) -> Principal:
    """The caller, who must be an admin (403 otherwise, before the body is even read).
    Read afresh: the cached principal may predate a demotion made through another API
    process (PATCH /v1/users/{name} drops the entries of its own process only), and these
    routes (tokens, permissions, quotas) are few and rarely called."""
    if user.is_admin:
        factory = request.app.state.read_sessions
        if await run_in_threadpool(_is_admin_now, factory, user.id):
            return user
        request.app.state.token_cache.drop_user(user.id)
    raise ApiError(403, "only admins may do this", code="forbidden")


def from_trusted_proxy(request: Request) -> bool:
    """Whether the peer is a reverse proxy in TORCHYARD_TRUSTED_PROXIES, whose
    X-Forwarded-* headers are believed (anyone else's are ignored)."""
    proxies = request.app.state.settings.trusted_proxy_networks
    if not proxies or request.client is None:
        return False
    try:
        peer = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    return any(peer in net for net in proxies)


def client_address(request: Request) -> str | None:
    """The client's address as the audit trail records it: the peer's, or, when the peer is
    a trusted proxy, the last X-Forwarded-For value (the one that proxy appended). A header
    from anyone else is never read, so a client cannot write another address into the
    trail."""
    if from_trusted_proxy(request):
        forwarded = request.headers.get("x-forwarded-for", "").split(",")[-1].strip()
        if forwarded:
            return forwarded[:100]
    return request.client.host if request.client else None


def actor_of(request: Request, user: Principal) -> Actor:
    """The audit trail's view of the caller."""
    return Actor(user.id, user.name, client_address(request))


async def current_actor(
    request: Request, user: Annotated[Principal, Depends(current_user)]
) -> Actor:
    return actor_of(request, user)


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": the session is closed when the route returns, before the response is
# sent, so a slow or stalled client never holds a connection or a transaction.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
CurrentUser = Annotated[Principal, Depends(current_user)]
AdminUser = Annotated[Principal, Depends(admin_user)]
CurrentActor = Annotated[Actor, Depends(current_actor)]
