"""One error shape for every failure: `{"error": {"code", "message", "details"}}`.

ApiError is raised by routes; the handlers below also turn FastAPI's own errors
(validation, 404 for unknown routes, 405), the store's (illegal transition) and a refused
submit (scheduler/submit.py: `refused`, the one mapping of its refusals) into it.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import psycopg_pool
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from torchyard.api.schemas import ErrorBody
from torchyard.scheduler.submit import SubmitRefused
from torchyard.store.states import IllegalTransition

log = logging.getLogger(__name__)

CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "validation_error",
    429: "too_many_requests",
    500: "internal_error",
    503: "unavailable",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        details: Any = None,
        headers: dict[str, str] | None = None,
    ):
        self.status, self.message, self.details = status, message, details
        self.code = code or CODES.get(status, "error")
        self.headers = headers
        super().__init__(message)


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    details: Any = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "code": code or CODES.get(status, "error"),
            "message": message,
            "details": details,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def validation_error(problems: list[tuple[str, str]], what: str = "request") -> ApiError:
    """422 naming every problem: the message lists them, details has one entry each."""
    listed = "; ".join(f"{f}: {m}" for f, m in problems)
    return ApiError(
        422,
        f"invalid {what}: {listed}",
        details=[{"field": f, "message": m} for f, m in problems],
    )


def not_found(what: str = "job") -> ApiError:
    return ApiError(404, f"{what} not found")


# A refused submit's status, by the refusal's code.
REFUSED_STATUS = {
    "invalid": 422,
    "forbidden": 403,
    "quota_exceeded": 429,
    "idempotency_conflict": 409,
}


def refused(e: SubmitRefused) -> ApiError:
    """A refused submit as the API answers it: 422 naming every problem (code
    validation_error, as every 422), 403 forbidden, 429 quota_exceeded (nothing stored), 409
    idempotency_conflict."""
    code = None if e.code == "invalid" else e.code
    return ApiError(REFUSED_STATUS[e.code], e.message, code=code, details=e.details)


def _field(loc: tuple[Any, ...]) -> str:
    # ("query", "limit") -> "limit"; ("body", "x", 0) -> "body.x.0"
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("query", "path", "header", "cookie") and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts) or "request"


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status, exc.message, code=exc.code, details=exc.details, headers=exc.headers
    )


async def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        (_field(tuple(e.get("loc", ()))), str(e.get("msg", "invalid"))) for e in exc.errors()
    ]
    err = validation_error(problems)
    return error_response(err.status, err.message, details=err.details)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else CODES.get(exc.status_code, "error")
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _submit_refused(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SubmitRefused)
    return await _api_error(request, refused(exc))


async def _illegal_transition(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, IllegalTransition)
    return error_response(
        409,
        str(exc),
        code="illegal_transition",
        details={"state": exc.from_state, "requested": exc.to_state},
    )


RETRY_AFTER_S = 2


async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("database error: %s", exc)
    return error_response(
        503,
        "the database is unavailable; retry shortly",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _pool_exhausted(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("no database connection free: %s", exc)
    return error_response(
        503,
        "the server is busy (no database connection free); retry shortly",
        code="busy",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal error; the server log has the details")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(SubmitRefused, _submit_refused)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(InterfaceError, _database_down)
    app.add_exception_handler(PoolTimeout, _pool_exhausted)
    # The async reads (store/asyncreads.py) raise psycopg's own errors.
    app.add_exception_handler(psycopg.OperationalError, _database_down)
    app.add_exception_handler(psycopg_pool.PoolTimeout, _pool_exhausted)
    app.add_exception_handler(Exception, _unexpected)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting the error body for each status."""
    descriptions = {
        401: "missing, unknown or revoked bearer token",
        403: "the user may not do this (e.g. run their own code without the permission)",
        404: "no such job or bundle (or not yours), or no such file",
        409: "conflict: illegal state transition, or Idempotency-Key reused with another spec",
        413: "request body over the configured limit",
        415: "the body's Content-Type is not one this route takes",
        416: "range not satisfiable",
        422: "invalid request; details lists every problem as {field, message}",
        429: "over the user's or the project's quota (max_queued): nothing was stored",
        503: "store or broker unreachable",
    }
    return {s: {"model": ErrorBody, "description": descriptions.get(s, CODES[s])} for s in statuses}
