"""The dashboard's reads beyond the public routes: the jobs table (a filtered page with the
columns it shows), its live stream, and where a job page's event stream should start.
Each is authorised like every route (CurrentUser): a user sees their own jobs, an admin
everyone's."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from torchyard.api.deps import CurrentUser, ReadSessionDep
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.schemas import Progress
from torchyard.api.streams import guarded_stream
from torchyard.api.ui_feed import JobChanges
from torchyard.api.views import owner_reason
from torchyard.contracts.states import JobState
from torchyard.store.jobs import get_job
from torchyard.store.states import STATES
from torchyard.store.uijobs import feed_head, state_counts, table_page

router = APIRouter(prefix="/v1/ui", tags=["dashboard"])

PING_S = 15.0
MAX_OFFSET = 1_000_000


class TableRow(BaseModel):
    model_config = ConfigDict(use_enum_values=True)  # the state as its plain name

    id: str
    name: str
    owner: str
    project: str | None = Field(default=None, description="its project (`~<user>`: personal)")
    state: JobState
    progress: Progress | None
    world_size: int
    attempt: int
    workers: list[str] = Field(description="the workers of its running attempt, by rank")
    latest: dict[str, float | None] = Field(description="train/loss and val/accuracy, when recorded")  # fmt: skip
    pending_reason: str | None
    sweep_id: str | None
    pruned: bool = Field(default=False, description="a sweep's pruner stopped it (GET /v1/jobs)")
    tags: list[str] = Field(default=[], description="its tags (PATCH /v1/jobs/{id})")
    params: dict[str, str | int | float | bool] = Field(
        default={}, description="its spec's params (the table's parameter columns)"
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class TablePage(BaseModel):
    items: list[TableRow]
    total: int = Field(description="jobs matching the filters")
    counts: dict[str, int] = Field(description="jobs by state matching the text filter")


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _row(r: dict[str, Any]) -> TableRow:
    progress = r["progress"] if isinstance(r["progress"], dict) else None
    reason = owner_reason(r["pending_reason"], r["id"], r["owner"])  # api/views.py
    pruned = bool(r["pruned"]) and r["state"] in (JobState.CANCELLING, JobState.CANCELLED)
    return TableRow.model_validate(
        {**r, "progress": progress, "latest": {k: _finite(v) for k, v in r["latest"].items()},
         "pending_reason": reason, "pruned": pruned, "params": r["params"] or {}}
    )  # fmt: skip


@router.get(
    "/jobs",
    response_model=TablePage,
    summary="The dashboard's jobs table",
    description="Newest first; admins see every user's jobs. `q` matches the name, the start "
    "of the id, and for admins the owner; `tag` keeps the jobs with that tag.",
    responses=responses(401, 422, 503),
)
def jobs_table(
    user: CurrentUser,
    session: ReadSessionDep,
    state: Annotated[list[str] | None, Query()] = None,
    q: Annotated[str | None, Query(max_length=200)] = None,
    tag: Annotated[str | None, Query(max_length=64)] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> TablePage:
    states = [s.strip() for v in state or [] for s in v.split(",") if s.strip()]
    bad = [s for s in states if s not in STATES]
    if bad:
        raise validation_error([("state", f"unknown state(s) {bad}; one of {list(STATES)}")])
    text = (q or "").strip() or None
    tag = (tag or "").strip() or None
    counts = state_counts(session, user.viewer, text, tag)
    total = sum(n for s, n in counts.items() if not states or s in states)
    rows = table_page(
        session, user.viewer, states=states, text=text, tag=tag, offset=offset, limit=limit
    )
    return TablePage(items=[_row(r) for r in rows], total=total, counts=counts)


@router.get(
    "/jobs/changes",
    response_class=EventSourceResponse,
    summary="The jobs table's live stream",
    description='Server-sent `changes` events, `{"jobs": [ids]}`: jobs the caller may see '
    "changed (state, progress, curves, attempts, new jobs). Reload the rows on each.",
    responses={200: {"content": {"text/event-stream": {}}}, **responses(401, 429, 503)},
)
async def job_changes(request: Request, user: CurrentUser) -> EventSourceResponse:
    hub: JobChanges | None = getattr(request.app.state, "ui_changes", None)
    if hub is None:
        poll_s = 2 * request.app.state.feed_poll_s
        hub = JobChanges(lambda: request.app.state.read_sessions, poll_s)
        request.app.state.ui_changes = hub
    return EventSourceResponse(
        guarded_stream(request, user, hub.follow(user.viewer)),  # cap (429), revocation
        headers={"Cache-Control": "no-cache"},
        ping=PING_S,
    )


class StreamStart(BaseModel):
    last_event_id: str = Field(description="pass to GET /v1/jobs/{id}/events to skip history")


@router.get(
    "/jobs/{job_id}/stream-start",
    response_model=StreamStart,
    summary="Where a job page's event stream starts",
    description="The job's event feed position now: read it, then the job and its curves, "
    "then follow the events from it.",
    responses=responses(401, 404, 503),
)
def stream_start(job_id: str, user: CurrentUser, session: ReadSessionDep) -> StreamStart:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    return StreamStart(last_event_id=feed_head(session, job_id).encode())
