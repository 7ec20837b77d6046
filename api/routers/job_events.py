"""A job's live event stream (server-sent events): `GET /v1/jobs/{job_id}/events`, served
from this process's feed hub (api.fanout), so any number of followers of one job cost one
store poll per tick."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import CurrentUser, Principal
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.fanout import FeedHub
from torchyard.api.streams import guarded_stream
from torchyard.store.feed import BadFeedCursor, FeedCursor
from torchyard.store.jobs import get_job

router = APIRouter(prefix="/v1/jobs", tags=["job data"])

PING_S = 15.0  # a comment line this often keeps idle proxies from closing the stream


def _visible(factory: sessionmaker[Session], user: Principal, job_id: str) -> bool:
    with factory() as session:
        return get_job(session, user.viewer, job_id) is not None


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    summary="Live events (server-sent events)",
    description=(
        "A `text/event-stream` of `state` (job state changes, from the first `queued`), "
        "`metric` (each new point: name, step, epoch, value, time) and `checkpoint` events "
        "(id, step, epoch, kind, bytes, sha256, attempt, created_at), each with an `id:`; "
        "reconnect with `Last-Event-ID` (or `?last_event_id=`) to resume after it. A "
        "`status` event (`pending_reason`, `log_size` in bytes; no `id:`) comes first and "
        "again whenever either changes, so a follower knows when to read more of the log "
        "(`GET /v1/jobs/{id}/logs`). The stream ends with an `end` event once the job has "
        "ended and everything was sent. A user may hold TORCHYARD_MAX_STREAMS_PER_USER "
        "streams open at once (429 with Retry-After past it); a stream ends within seconds "
        "of its token being revoked, its dashboard session logged out, or the user's role in "
        "the job's project taken away."
    ),
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the event stream"},
        **responses(401, 404, 422, 429, 503),
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
) -> EventSourceResponse:
    try:
        cursor = FeedCursor.parse(last_event_id_header or last_event_id)
    except BadFeedCursor as e:
        raise validation_error([("Last-Event-ID", str(e))]) from None
    if not await run_in_threadpool(_visible, request.app.state.read_sessions, user, job_id):
        raise not_found()
    hub: FeedHub = request.app.state.feed_hub
    frames = hub.follow(job_id, cursor, request.app.state.feed_poll_s)
    factory = request.app.state.read_sessions

    async def still_visible() -> bool:  # a role taken away in the job's project ends it
        return await run_in_threadpool(_visible, factory, user, job_id)

    return EventSourceResponse(
        # the user's stream cap (429), revocation, the project's roles
        guarded_stream(request, user, frames, still_visible),
        headers={"Cache-Control": "no-cache"},
        ping=PING_S,
    )
