"""The dashboard: its page and assets (built by scripts/build_web.sh into api/static/), and
its logins.

The page is static and the same for everyone (no user's data is ever in the HTML); it
reads everything through the API, authenticated by an HttpOnly, SameSite=Strict session
cookie rather than a token: a cookie is what lets the browser's own download links and
EventSource streams carry the login, while a token the page held would have to go into
URLs (kept in history and logs) or into JavaScript-readable storage. The cookie is made
from an API token, typed on the login page or, through `torchyard ui`, from a one-time
secret that arrives in the URL's fragment (never sent to a server, so never in its logs)
and is good for one exchange within five minutes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import (
    SESSION_COOKIE,
    CurrentUser,
    Principal,
    TokenCache,
    actor_of,
    client_address,
    from_trusted_proxy,
)
from torchyard.api.errors import ApiError, responses
from torchyard.store.audit import Actor, record
from torchyard.store.auth import hash_token, revoke_token
from torchyard.store.sso import session_sso_token
from torchyard.store.uisessions import (
    LINK_TTL_S,
    SESSION_TTL_S,
    create_login_link,
    create_session,
    csrf_token,
    end_session,
    redeem_login_link,
    token_id_for,
    user_for_session,
)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# The page's own paths (the page routes them itself); everything else stays the API's.
PAGES = ("/", "/login", "/workers", "/submit", "/compare", "/jobs/{job_id}", "/sweeps",
         "/sweeps/{sweep_id}", "/projects", "/projects/{name}")  # fmt: skip
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}
WWW_AUTH = {"WWW-Authenticate": "Bearer"}
IMMUTABLE = "public, max-age=31536000, immutable"
_ASSET = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$")
# esbuild's content hash in a file name: app-5XQ2KJ3M.js
_HASHED = re.compile(r"-[A-Z0-9]{8}\.(js|css)$")
_TYPES = {".js": "text/javascript", ".css": "text/css", ".map": "application/json",
          ".svg": "image/svg+xml", ".png": "image/png"}  # fmt: skip

router = APIRouter(tags=["dashboard"])


def static_dir(request: Request) -> Path:
    return Path(getattr(request.app.state, "ui_static", STATIC_DIR))


def _page(request: Request) -> Response:
    index = static_dir(request) / "index.html"
    try:
        html = index.read_bytes()
    except FileNotFoundError:
        return HTMLResponse(
            "<!doctype html><title>torchyard</title><p>The dashboard is not built: run "
            "<code>bash scripts/build_web.sh</code> (or use a wheel, which includes it).",
            status_code=503,
            headers={**PAGE_HEADERS, "Cache-Control": "no-store"},
        )
    return HTMLResponse(html, headers={**PAGE_HEADERS, "Cache-Control": "no-cache"})


for _path in PAGES:
    router.add_api_route(
        _path, _page, methods=["GET"], include_in_schema=False, response_class=HTMLResponse
    )


@router.get("/assets/{name}", include_in_schema=False)
def asset(name: str, request: Request) -> Response:
    """A built file; hashed names never change, so browsers keep them for a year."""
    if not _ASSET.match(name):
        raise ApiError(404, "no such asset")
    path = static_dir(request) / "assets" / name
    if not path.is_file():
        raise ApiError(404, "no such asset")
    cache = IMMUTABLE if _HASHED.search(name) else "no-cache"
    headers = {"Cache-Control": cache, "X-Content-Type-Options": "nosniff", "Vary": "Accept-Encoding"}  # fmt: skip
    media = _TYPES.get(path.suffix, "application/octet-stream")
    gz = path.with_name(name + ".gz")
    if "gzip" in request.headers.get("accept-encoding", "") and gz.is_file():
        return FileResponse(gz, media_type=media, headers={**headers, "Content-Encoding": "gzip"})
    return FileResponse(path, media_type=media, headers=headers)


# --- logins --------------------------------------------------------------------------------


class LoginLink(BaseModel):
    secret: str = Field(description="good for one exchange (POST /v1/ui/sessions)")
    path: str = Field(description="append to the server's URL: the page exchanges the secret")
    expires_in_s: float


class SessionIn(BaseModel):
    login: str | None = Field(
        default=None, max_length=200, description="a login link's secret; absent: the token"
    )


class SessionOut(BaseModel):
    user: str
    is_admin: bool
    can_run_code: bool
    csrf: str | None = Field(
        description="send as X-CSRF-Token with every POST/PUT/DELETE made with the cookie"
    )


def came_over_tls(request: Request) -> bool:
    """Whether the browser's request came over https: to this server directly, or to a
    reverse proxy in TORCHYARD_TRUSTED_PROXIES that says so in `X-Forwarded-Proto` (its
    last value: the one the nearest proxy set). Anyone else's header is ignored."""
    if request.url.scheme == "https":
        return True
    if not from_trusted_proxy(request):
        return False
    sent = request.headers.get("x-forwarded-proto", "").split(",")[-1].strip().lower()
    return sent == "https"


def _bearer_token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _make_link(factory: sessionmaker[Session], token: str) -> str | None:
    with factory() as session:
        token_id = token_id_for(session, token)
        if token_id is None:
            return None
        secret = create_login_link(session, token_id)
        session.commit()
        return secret


@router.post(
    "/v1/ui/login-links",
    response_model=LoginLink,
    status_code=201,
    summary="A one-time dashboard login",
    description="For `torchyard ui`: a secret that logs the browser in as the calling token "
    "(once, within 5 minutes). Needs the token itself (`Authorization: Bearer`), not a "
    "dashboard session.",
    responses=responses(401, 403, 503),
)
async def make_login_link(request: Request, user: CurrentUser) -> LoginLink:
    del user  # authenticated above; the link belongs to the token itself
    token = _bearer_token(request)
    if token is None:
        raise ApiError(403, "a login link is made with an API token, not a session")
    secret = await run_in_threadpool(_make_link, request.app.state.sessions, token)
    if secret is None:
        raise ApiError(401, "unknown or revoked token", headers=WWW_AUTH)
    return LoginLink(secret=secret, path=f"/#login={secret}", expires_in_s=LINK_TTL_S)


def _open_session(
    factory: sessionmaker[Session], token: str | None, login: str | None, client: str | None
) -> tuple[str, Any] | None:
    """(session secret, its user), from a login secret or a token; None: refused. The
    login is in the audit trail, as who logged in, with what, from where."""
    with factory() as session:
        token_id = (
            redeem_login_link(session, login) if login else token_id_for(session, token or "")
        )
        if token_id is None:
            session.rollback()
            return None
        secret = create_session(session, token_id)
        user = user_for_session(session, secret)
        if user is None:  # the token was revoked in between: no session, no entry
            session.rollback()
            return None
        actor = Actor(user.id, user.name, client)
        details = {"via": "login link" if login else "token", "token_id": token_id}
        record(session, actor, "auth.login", f"user:{user.name}", details)
        session.commit()
        return secret, user


@router.post(
    "/v1/ui/sessions",
    response_model=SessionOut,
    status_code=201,
    summary="Log the dashboard in",
    description='Exchanges a login link\'s secret (`{"login": secret}`) or the token in '
    "`Authorization: Bearer` for a session cookie (HttpOnly, SameSite=Strict; Secure over "
    "https). The body must be JSON, which another site cannot send.",
    responses=responses(401, 415, 503),
)
async def open_session(
    request: Request,
    response: Response,
    body: Annotated[SessionIn, Body()],
) -> SessionOut:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise ApiError(415, "send the login as application/json")
    token = _bearer_token(request)
    if not body.login and token is None:
        raise ApiError(401, "give a login link's secret or a token", headers=WWW_AUTH)
    opened = await run_in_threadpool(
        _open_session, request.app.state.sessions, token, body.login, client_address(request)
    )
    if opened is None or opened[1] is None:
        what = "login link expired or already used" if body.login else "unknown or revoked token"
        raise ApiError(401, what + ": log in again", headers=WWW_AUTH)
    secret, user = opened
    response.set_cookie(
        SESSION_COOKIE,
        secret,
        max_age=int(SESSION_TTL_S),
        httponly=True,
        samesite="strict",
        secure=came_over_tls(request),
        path="/",
    )
    response.headers["Cache-Control"] = "no-store"
    principal = Principal(user.id, user.name, user.is_admin, user.can_run_code)
    return _session_out(principal, csrf_token(secret))


@router.get(
    "/v1/ui/session",
    response_model=SessionOut,
    summary="Who the dashboard is logged in as",
    description="The caller, and with a session cookie its CSRF token (a reloaded page "
    "keeps it in memory only).",
    responses=responses(401, 503),
)
def get_session(request: Request, response: Response, user: CurrentUser) -> SessionOut:
    cookie = request.cookies.get(SESSION_COOKIE)
    response.headers["Cache-Control"] = "no-store"
    csrf = csrf_token(cookie) if cookie and _bearer_token(request) is None else None
    return _session_out(user, csrf)


def _session_out(user: Principal, csrf: str | None) -> SessionOut:
    return SessionOut(
        user=user.name, is_admin=user.is_admin, can_run_code=user.can_run_code, csrf=csrf
    )


def _end(factory: sessionmaker[Session], secret: str, actor: Actor) -> list[str]:
    """Ends the session; a single sign-on's token (store/sso.py) is revoked with it.
    Returns the token cache keys of what was revoked."""
    with factory() as session:
        live = user_for_session(session, secret) is not None
        sso_token = session_sso_token(session, secret)
        end_session(session, secret)
        revoked = revoke_token(session, sso_token, None) if sso_token is not None else None
        if live:  # a cookie of an ended session ends nothing
            record(session, actor, "auth.logout", f"user:{actor.name}")
        session.commit()
    if revoked is None:
        return []
    return [revoked[0], *("session:" + h for h in revoked[1])]


@router.delete(
    "/v1/ui/session",
    status_code=204,
    summary="Log the dashboard out",
    description="Ends the session of the cookie (with its X-CSRF-Token) and clears it.",
    responses=responses(401, 403, 503),
)
async def log_out(request: Request, user: CurrentUser) -> Response:
    out = Response(status_code=204)
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        ended = await run_in_threadpool(
            _end, request.app.state.sessions, cookie, actor_of(request, user)
        )
        cache: TokenCache = request.app.state.token_cache
        for key in ["session:" + hash_token(cookie), *ended]:
            cache.drop(key)
    out.delete_cookie(
        SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=came_over_tls(request)
    )
    return out
