"""Liveness, readiness (database and broker reachable) and Prometheus metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import current_user
from torchyard.api.errors import ApiError, error_response, responses
from torchyard.api.schemas import Health, Readiness
from torchyard.broker import app as broker
from torchyard.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])

READY_TIMEOUT_S = 3.0


@router.get("/healthz", response_model=Health, summary="Liveness (no token needed)")
async def healthz() -> Health:
    return Health(status="ok")


def _db_ok(factory: sessionmaker[Session]) -> bool:
    try:
        with factory() as session:
            session.execute(text("SELECT 1"))
        return True
    except Exception as e:
        log.warning("readiness: database unreachable: %s", e)
        return False


async def _check(fn: object, *args: object) -> bool:
    try:
        return bool(
            await asyncio.wait_for(run_in_threadpool(fn, *args), READY_TIMEOUT_S)  # type: ignore[arg-type]
        )
    except TimeoutError:
        return False


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness (no token needed)",
    description="200 when the database answers and the broker accepts a connection; "
    "503 (error body, details naming which) when either does not.",
    responses=responses(503),
)
async def readyz(request: Request) -> Response:
    db, br = await asyncio.gather(
        _check(_db_ok, request.app.state.read_sessions),
        _check(broker.broker_ok, request.app.state.settings, 1.0),
    )
    if db and br:
        return JSONResponse({"status": "ok", "database": True, "broker": True})
    down = [n for n, ok in (("database", db), ("broker", br)) if not ok]
    return error_response(
        503,
        f"not ready: {' and '.join(down)} unreachable",
        details={"database": db, "broker": br},
    )


async def _scraper(request: Request) -> None:
    """Who may read the pool-wide counts: the scrape token (TORCHYARD_METRICS_TOKEN, compared
    in constant time) or an admin; any other user is 403."""
    settings: Settings = request.app.state.settings
    scheme, sent = get_authorization_scheme_param(request.headers.get("Authorization"))
    wanted = settings.metrics_token
    bearer = sent if scheme.lower() == "bearer" else ""
    if wanted and bearer and hmac.compare_digest(bearer.encode(), wanted.encode()):
        return
    user = await current_user(request)
    if not user.is_admin:
        raise ApiError(
            403,
            "metrics are for admins or the scrape token (TORCHYARD_METRICS_TOKEN)",
            code="forbidden",
        )


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    description="Jobs and workers by state and request counters, for the whole pool: an "
    "admin's token, or `Authorization: Bearer` with TORCHYARD_METRICS_TOKEN (a scraper that "
    "is no user).",
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
        **responses(401, 403),
    },
)
async def prometheus_metrics(request: Request) -> Response:
    await _scraper(request)
    registry: CollectorRegistry = request.app.state.prometheus
    body = await run_in_threadpool(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
