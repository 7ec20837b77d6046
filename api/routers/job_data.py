"""What a job feeds while it runs: loss curves, its log, and a live event stream."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import CurrentUser, Principal, ReadSessionDep, SettingsDep
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.schemas import LogChunk, MetricsOut, Series
from torchyard.store.feed import BadFeedCursor, FeedCursor, FeedItem, FeedPage, poll
from torchyard.store.jobs import get_job
from torchyard.store.metrics import query_page, query_series
from torchyard.store.paths import LOG_FILE, job_dir, resolve_inside
from torchyard.store.states import TERMINAL

router = APIRouter(prefix="/v1/jobs", tags=["job data"])

MAX_POINTS_LIMIT = 10_000
KEEPALIVE_S = 15.0


@router.get(
    "/{job_id}/metrics",
    response_model=MetricsOut,
    response_model_exclude_none=True,
    summary="Loss curves",
    description=(
        "`{series: {name: {steps, values}}}`, steps ascending. `name` repeats or is "
        "comma-separated (default: every metric); `after_step` returns only later points "
        "(for polling); `max_points` downsamples each curve to at most that many buckets of "
        "steps, each giving its last point plus the bucket's `min` and `max`, so spikes show. "
        "Without `max_points` the raw points come in pages of at most "
        "TORCHYARD_METRICS_PAGE_POINTS per curve: follow `next_after_step` as `after_step`."
    ),
    responses=responses(401, 404, 422, 503),
)
def get_metrics(
    job_id: str,
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    name: Annotated[list[str] | None, Query(description="metric name(s), e.g. train/loss")] = None,
    after_step: Annotated[int | None, Query(ge=-(2**62), le=2**62)] = None,
    max_points: Annotated[int | None, Query(ge=1, le=MAX_POINTS_LIMIT)] = None,
) -> MetricsOut:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    names = [n.strip() for v in name or [] for n in v.split(",") if n.strip()]
    too_long = [n for n in names if len(n) > 100]
    if too_long:
        raise validation_error([("name", "metric names are at most 100 characters")])
    wanted = list(dict.fromkeys(names)) or None
    if max_points is not None:
        series = query_series(
            session, job_id, names=wanted, after_step=after_step, max_points=max_points
        )
        return MetricsOut(series={k: Series(**v) for k, v in series.items()})
    # Raw points come in pages: a million-point curve is never one response.
    series, next_after = query_page(
        session, job_id, names=wanted, after_step=after_step, limit=settings.metrics_page_points
    )
    return MetricsOut(
        series={k: Series(**v) for k, v in series.items()}, next_after_step=next_after
    )


def _utf8_cut(chunk: bytes) -> int:
    """Length of `chunk` without a trailing incomplete UTF-8 character."""
    i = len(chunk) - 1
    while i >= 0 and len(chunk) - i <= 4 and chunk[i] & 0xC0 == 0x80:
        i -= 1  # continuation bytes
    if i < 0:
        return len(chunk)
    lead = chunk[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    return i if i + need > len(chunk) and i > 0 else len(chunk)


@router.get(
    "/{job_id}/logs",
    response_model=LogChunk,
    summary="The trainer's output",
    description=(
        "Bytes `offset` to `offset + limit` of the job's log (all attempts, one header line "
        "each), as text. Follow with `offset = next_offset` until `complete`."
    ),
    responses=responses(401, 404, 422, 503),
)
def get_logs(
    job_id: str,
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=4 * 1024 * 1024)] = 256 * 1024,
) -> LogChunk:
    found = get_job(session, user.viewer, job_id)
    if found is None:
        raise not_found()
    job = found[0]
    terminal = job.state in TERMINAL
    path = resolve_inside(job_dir(settings.storage, job.id), LOG_FILE)
    try:
        f = open(path, "rb")  # noqa: SIM115
    except (FileNotFoundError, NotADirectoryError):
        return LogChunk(data="", offset=0, next_offset=0, size=0, complete=terminal)
    with f:
        size = os.fstat(f.fileno()).st_size
        start = min(offset, size)
        f.seek(start)
        chunk = f.read(limit)
    if start + len(chunk) < size:
        chunk = chunk[: _utf8_cut(chunk)]
    end = start + len(chunk)
    return LogChunk(
        data=chunk.decode("utf-8", errors="replace"),
        offset=start,
        next_offset=end,
        size=size,
        complete=terminal and end >= size,
    )


def _visible(factory: sessionmaker[Session], user: Principal, job_id: str) -> bool:
    with factory() as session:
        return get_job(session, user.viewer, job_id) is not None


def _poll(factory: sessionmaker[Session], job_id: str, cursor: FeedCursor) -> FeedPage:
    with factory() as session:
        return poll(session, job_id, cursor)


def _frame(item: FeedItem) -> str:
    data = json.dumps(item.data, separators=(",", ":"))
    return f"id: {item.cursor.encode()}\nevent: {item.type}\ndata: {data}\n\n"


async def _stream(
    factory: sessionmaker[Session], job_id: str, cursor: FeedCursor, poll_s: float
) -> AsyncIterator[str]:
    yield "retry: 2000\n\n"
    quiet_since = time.monotonic()
    while True:
        page = await run_in_threadpool(_poll, factory, job_id, cursor)
        for item in page.items:
            yield _frame(item)
        cursor = page.cursor
        if page.finished:
            end = {"state": page.state}
            yield f"id: {cursor.encode()}\nevent: end\ndata: {json.dumps(end)}\n\n"
            return
        if page.items:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = time.monotonic()
        if not page.more:
            await asyncio.sleep(poll_s)


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    summary="Live events (server-sent events)",
    description=(
        "A `text/event-stream` of `state` (job state changes, from the first `queued`), "
        "`metric` (each new point: name, step, epoch, value, time) and `checkpoint` events "
        "(id, step, epoch, kind, bytes, sha256, attempt, created_at), each with an `id:`; "
        "reconnect with `Last-Event-ID` (or `?last_event_id=`) to resume after it. The stream "
        "ends with an `end` event once the job has ended and everything was sent."
    ),
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the event stream"},
        **responses(401, 404, 422, 503),
    },
)
async def job_events(
    job_id: str,
    request: Request,
    user: CurrentUser,
    last_event_id_header: Annotated[
        str | None, Header(alias="Last-Event-ID", max_length=100)
    ] = None,
    last_event_id: Annotated[str | None, Query(max_length=100)] = None,
) -> StreamingResponse:
    factory = request.app.state.read_sessions
    try:
        cursor = FeedCursor.parse(last_event_id_header or last_event_id)
    except BadFeedCursor as e:
        raise validation_error([("Last-Event-ID", str(e))]) from None
    if not await run_in_threadpool(_visible, factory, user, job_id):
        raise not_found()
    return StreamingResponse(
        _stream(factory, job_id, cursor, request.app.state.feed_poll_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
