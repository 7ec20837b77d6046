"""Single sign-on routes (OpenID Connect; the provider's side is api/oidc.py, the rows
store/sso.py). Every route here is public: each is a step of a sign-in, not a use of one.

The dashboard (authorization code flow with PKCE): `GET /v1/ui/sso/login` stores a sign-in
(state, nonce, verifier) and sends the browser to the provider with a cookie that binds the
sign-in to it (`ty_sso`: HttpOnly, SameSite=Lax, since it must come back on the provider's
cross-site redirect; only its hash is stored); `GET /v1/ui/sso/callback` uses the sign-in
once, exchanges the code, checks the ID token, maps the user, issues an API token (label
`sso`) and makes the dashboard session from it as a login link does, then redirects to one
of the dashboard's own paths. The session cookie (SameSite=Strict) is set on our own
response; the redirect after it is a top-level navigation that started cross-site, so its
page request may go without the cookie, but the page's own API calls carry it.

The CLI (device authorization grant, RFC 8628), with the client secret kept here:
`POST /v1/auth/device` starts one at the provider; `POST /v1/auth/device/token` asks it and
answers RFC 8628's `authorization_pending`, `slow_down`, `expired_token`, `access_denied` as
400 with that code, or an ordinary API token (label `sso-cli`). Nothing of a device sign-in
is stored here. These unauthenticated routes are bounded per client address (429), and a
device code polled faster than its interval gets `slow_down`.
"""

from __future__ import annotations

import html
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import SESSION_COOKIE, client_address
from torchyard.api.errors import ApiError, error_response, responses
from torchyard.api.oidc import OidcClient, OidcError, ProviderRefused
from torchyard.api.routers.ui import came_over_tls
from torchyard.store.audit import Actor, record
from torchyard.store.auth import hash_token
from torchyard.store.sso import (
    LOGIN_TTL_S,
    SSO_CLI_LABEL,
    SSO_LABEL,
    GroupRules,
    Identity,
    SsoRefused,
    sign_in,
    start_login,
    take_login,
)
from torchyard.store.uisessions import SESSION_TTL_S, create_session

BROWSER_COOKIE = "ty_sso"
LOGIN_PATH = "/v1/ui/sso/login"
CALLBACK_PATH = "/v1/ui/sso/callback"
# RFC 8628's default interval, and the shortest we let a device code be polled at.
DEVICE_INTERVAL_S = 5.0
DEVICE_ERRORS = frozenset({"authorization_pending", "slow_down", "expired_token", "access_denied"})
# Requests per client address per minute (a proxy's clients share one address).
LIMITS = {"login": 60, "device": 20, "poll": 120}
# A dashboard path to land on: its own, never another host (`//x`, `/\x`) nor the API.
_NEXT = re.compile(r"^/(?![/\\]|v1/)[A-Za-z0-9/_.~%?=&+-]{0,199}$")

router = APIRouter(tags=["single sign-on"])


class RateLimit:
    """At most `per_minute` requests per key in each minute (a fixed window), bounded in
    keys: an address over it is answered 429 with Retry-After."""

    def __init__(self, per_minute: int, max_keys: int = 10_000):
        self.per_minute, self.max_keys = per_minute, max_keys
        self._windows: dict[str, tuple[float, int]] = {}

    def hit(self, key: str) -> float | None:
        """Count one request; None when allowed, else the seconds to wait."""
        now = time.monotonic()
        start, count = self._windows.get(key, (now, 0))
        if now - start >= 60:
            start, count = now, 0
        if count >= self.per_minute:
            return 60 - (now - start)
        if len(self._windows) >= self.max_keys:
            self._windows.clear()
        self._windows[key] = (start, count + 1)
        return None


@dataclass
class SsoState:
    """The process's single sign-on: the provider's client and the routes' bounds."""

    client: OidcClient
    rules: GroupRules
    limits: dict[str, RateLimit] = field(
        default_factory=lambda: {k: RateLimit(n) for k, n in LIMITS.items()}
    )
    polls: dict[str, float] = field(default_factory=dict)  # device code's hash → last poll


def _sso(request: Request) -> SsoState:
    settings = request.app.state.settings
    if not settings.sso_enabled:
        raise ApiError(404, "single sign-on is not configured on this server "
                       "(TORCHYARD_OIDC_ISSUER, TORCHYARD_OIDC_CLIENT_ID)", code="sso_off")  # fmt: skip
    state: SsoState | None = getattr(request.app.state, "sso", None)
    if state is None:
        rules = GroupRules(settings.oidc_admin_group_set, settings.oidc_project_role_map)
        state = request.app.state.sso = SsoState(OidcClient(settings), rules)
    return state


def _limit(request: Request, sso: SsoState, what: str) -> None:
    wait = sso.limits[what].hit(client_address(request) or "?")
    if wait is not None:
        raise ApiError(429, "too many sign-in requests from this address: wait a minute",
                       headers={"Retry-After": str(max(1, int(wait)))})  # fmt: skip


def _redirect_uri(request: Request) -> str:
    """Our callback's URL as the browser reaches us (https behind a trusted proxy that
    says so); the provider refuses any URL not registered for our client."""
    scheme = "https" if came_over_tls(request) else request.url.scheme
    return f"{scheme}://{request.url.netloc}{CALLBACK_PATH}"


# --- the dashboard -------------------------------------------------------------------------


class SsoInfo(BaseModel):
    enabled: bool
    name: str | None = Field(description="what the login page calls the provider")
    login_path: str | None = Field(description="where the browser goes to sign in")


@router.get(
    "/v1/ui/sso",
    response_model=SsoInfo,
    summary="Whether the dashboard offers single sign-on",
    description="Public: the login page asks before anyone is signed in.",
)
def sso_info(request: Request) -> SsoInfo:
    if not request.app.state.settings.sso_enabled:
        return SsoInfo(enabled=False, name=None, login_path=None)
    return SsoInfo(enabled=True, name=_sso(request).client.name, login_path=LOGIN_PATH)


def _start(factory: sessionmaker[Session], browser: str, next_path: str | None) -> Any:
    with factory() as session:
        started = start_login(session, browser, next_path)
        session.commit()
        return started


@router.get(
    LOGIN_PATH,
    status_code=302,
    response_class=RedirectResponse,
    summary="Sign the dashboard in at the OpenID provider",
    description="Redirects to the provider (authorization code flow with PKCE, a state and "
    "a nonce good once, for 10 minutes, in this browser only). `next`: a dashboard path "
    "to land on afterwards.",
    responses=responses(404, 429, 503),
)
async def sso_login(
    request: Request, next_: Annotated[str | None, Query(alias="next", max_length=200)] = None
) -> Response:
    sso = _sso(request)
    _limit(request, sso, "login")
    try:
        await sso.client.metadata()  # the provider answers before anything is stored
    except OidcError as e:
        return _failed(request, e.status, e.message, e.code)
    browser = secrets.token_urlsafe(32)
    next_path = next_ if next_ and _NEXT.match(next_) else None
    started = await run_in_threadpool(_start, request.app.state.sessions, browser, next_path)
    url = await sso.client.authorization_url(started, _redirect_uri(request))
    out = RedirectResponse(url, status_code=302, headers={"Cache-Control": "no-store"})
    out.set_cookie(BROWSER_COOKIE, browser, max_age=int(LOGIN_TTL_S), httponly=True,
                   samesite="lax", secure=came_over_tls(request), path="/v1/ui/sso")  # fmt: skip
    return out


def _failed(request: Request, status: int, message: str, code: str) -> Response:
    """A sign-in that failed: a page for a browser, the error shape for anything else."""
    if "text/html" in request.headers.get("accept", ""):
        page = (
            '<!doctype html><meta charset="utf-8"><title>torchyard: sign-in failed</title>'
            f'<main class="login"><h1>Sign-in failed</h1><p id="sso-error">{html.escape(message)}'
            '</p><p><a href="/login">Back to the sign-in page</a></p></main>'
        )
        out: Response = HTMLResponse(page, status_code=status)
    else:
        out = error_response(status, message, code=code)
    out.headers["Cache-Control"] = "no-store"
    out.delete_cookie(BROWSER_COOKIE, path="/v1/ui/sso", httponly=True, samesite="lax")
    return out


def _finish(
    factory: sessionmaker[Session], sso: SsoState, ident: Identity, client: str | None
) -> str:
    """The signed-in user's new SSO token and a dashboard session made from it (its
    secret), the login in the audit trail; SsoRefused when the account may not."""
    with factory() as session:
        user, row, _ = sign_in(session, ident, sso.rules, SSO_LABEL, client)
        secret = create_session(session, row.id)
        record(session, Actor(user.id, user.name, client), "auth.login", f"user:{user.name}",
               {"via": "sso", "token_id": row.id})  # fmt: skip
        session.commit()
        return secret


def _take(factory: sessionmaker[Session], state: str, browser: str) -> Any:
    with factory() as session:
        pending = take_login(session, state, browser)
        session.commit()
        return pending


@router.get(
    CALLBACK_PATH,
    status_code=303,
    response_class=RedirectResponse,
    summary="Where the OpenID provider sends the browser back",
    description="Uses the sign-in of `state` (once, in the browser that started it), "
    "exchanges `code`, checks the ID token, and logs the dashboard in (the session cookie) "
    "as the user the provider names. Every refusal logs nobody in.",
    responses=responses(400, 401, 403, 404, 503),
)
async def sso_callback(
    request: Request,
    state: Annotated[str, Query(max_length=200)] = "",
    code: Annotated[str | None, Query(max_length=2000)] = None,
    error: Annotated[str | None, Query(max_length=100)] = None,
    error_description: Annotated[str | None, Query(max_length=300)] = None,
    iss: Annotated[str | None, Query(max_length=300)] = None,
) -> Response:
    sso = _sso(request)
    browser = request.cookies.get(BROWSER_COOKIE, "")
    pending = await run_in_threadpool(_take, request.app.state.sessions, state, browser)
    if pending is None:
        return _failed(request, 400, "this sign-in is unknown, expired, already used or was "
                       "started in another browser: sign in again", "sso_state")  # fmt: skip
    if iss is not None and iss != sso.client.issuer:  # RFC 9207: another provider's answer
        return _failed(request, 400, f"the answer comes from issuer {iss!r}, not ours", "sso_issuer")  # fmt: skip
    if error or not code:
        said = f" ({error_description})" if error_description else ""
        return _failed(request, 403, f"the sign-in provider refused: {error or 'no code'}{said}", "sso_refused")  # fmt: skip
    try:
        tokens = await sso.client.exchange_code(code, pending.code_verifier, _redirect_uri(request))
        ident = await sso.client.identity(tokens, pending.nonce)
        secret = await run_in_threadpool(
            _finish, request.app.state.sessions, sso, ident, client_address(request)
        )
    except OidcError as e:
        return _failed(request, e.status, e.message, e.code)
    except SsoRefused as e:
        return _failed(request, 403, str(e), "sso_refused")
    out = RedirectResponse(pending.next_path or "/", status_code=303)
    out.headers["Cache-Control"] = "no-store"
    out.set_cookie(SESSION_COOKIE, secret, max_age=int(SESSION_TTL_S), httponly=True,
                   samesite="strict", secure=came_over_tls(request), path="/")  # fmt: skip
    out.delete_cookie(BROWSER_COOKIE, path="/v1/ui/sso", httponly=True, samesite="lax")
    return out


# --- the CLI: the device authorization grant -------------------------------------------------


class DeviceStart(BaseModel):
    device_code: str = Field(description="the secret to poll POST /v1/auth/device/token with")
    user_code: str = Field(description="the code the user confirms at the provider")
    verification_uri: str
    verification_uri_complete: str | None
    interval: float = Field(description="seconds between polls")
    expires_in: float


class DeviceTokenIn(BaseModel):
    device_code: str = Field(min_length=1, max_length=500)


class DeviceToken(BaseModel):
    token: str = Field(description="an ordinary API token (label `sso-cli`), shown once")
    token_id: int
    user: str


@router.post(
    "/v1/auth/device",
    response_model=DeviceStart,
    summary="Start a device sign-in at the OpenID provider (RFC 8628)",
    description="For `torchyard login URL --sso`: the user confirms `user_code` at "
    "`verification_uri` while the CLI polls POST /v1/auth/device/token. 404 where there is "
    "no single sign-on, or the provider has no device flow.",
    responses=responses(404, 429, 503),
)
async def device_start(request: Request, response: Response) -> DeviceStart:
    sso = _sso(request)
    _limit(request, sso, "device")
    try:
        got = await sso.client.device_start()
        uri = got["verification_uri"]
        start = DeviceStart(
            device_code=got["device_code"],
            user_code=got["user_code"],
            verification_uri=uri,
            verification_uri_complete=got.get("verification_uri_complete"),
            interval=max(float(got.get("interval") or 0), DEVICE_INTERVAL_S),
            expires_in=float(got.get("expires_in") or LOGIN_TTL_S),
        )
    except OidcError as e:
        raise ApiError(e.status if e.status != 401 else 503, e.message, code=e.code) from None
    except (KeyError, TypeError, ValueError):
        raise ApiError(503, "the sign-in provider's device answer is not RFC 8628's", code="sso_unavailable") from None  # fmt: skip
    response.headers["Cache-Control"] = "no-store"
    return start


def _too_soon(sso: SsoState, device_code: str) -> bool:
    """Whether this device code was polled less than DEVICE_INTERVAL_S ago (recorded)."""
    key, now = hash_token(device_code), time.monotonic()
    last = sso.polls.get(key)
    if len(sso.polls) >= 10_000:
        sso.polls.clear()
    sso.polls[key] = now
    return last is not None and now - last < DEVICE_INTERVAL_S


def _device_token(
    factory: sessionmaker[Session], sso: SsoState, ident: Identity, client: str | None
) -> DeviceToken:
    with factory() as session:
        user, row, secret = sign_in(session, ident, sso.rules, SSO_CLI_LABEL, client)
        record(session, Actor(user.id, user.name, client), "auth.login", f"user:{user.name}",
               {"via": "sso", "flow": "device", "token_id": row.id})  # fmt: skip
        session.commit()
        return DeviceToken(token=secret, token_id=row.id, user=user.name)


@router.post(
    "/v1/auth/device/token",
    response_model=DeviceToken,
    summary="Ask whether a device sign-in is done; its API token when it is",
    description="400 with code `authorization_pending` (not yet), `slow_down` (poll less "
    "often: add 5 s), `expired_token` or `access_denied` (start again), as RFC 8628 says; "
    "200 with a new API token (label `sso-cli`) once the user confirmed at the provider.",
    responses=responses(400, 403, 404, 422, 429, 503),
)
async def device_token(
    request: Request, response: Response, body: Annotated[DeviceTokenIn, Body()]
) -> DeviceToken:
    sso = _sso(request)
    _limit(request, sso, "poll")
    if _too_soon(sso, body.device_code):
        raise ApiError(400, "polled too often: wait longer between polls", code="slow_down")
    try:
        tokens = await sso.client.device_poll(body.device_code)
        ident = await sso.client.identity(tokens, None)
        out = await run_in_threadpool(
            _device_token, request.app.state.sessions, sso, ident, client_address(request)
        )
    except ProviderRefused as e:
        if e.error in DEVICE_ERRORS:
            raise ApiError(400, e.description or e.error, code=e.error) from None
        raise ApiError(403, e.message, code="sso_refused") from None
    except OidcError as e:  # a refusal is 403 here: no credential of ours was wrong
        raise ApiError(403 if e.status == 401 else e.status, e.message, code=e.code) from None
    except SsoRefused as e:
        raise ApiError(403, str(e), code="sso_refused") from None
    sso.polls.pop(hash_token(body.device_code), None)
    response.headers["Cache-Control"] = "no-store"
    return out
