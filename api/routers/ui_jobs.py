"""The dashboard's reads beyond the public routes: the jobs table (a filtered page with the
columns it shows: the metric columns asked for, sorted by a column and filtered by a
metric's latest value), its live stream, and where a job page's event stream should start.
Each is authorised like every route (CurrentUser): a user sees their own jobs, an admin
everyone's."""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from torchyard.api.deps import CurrentUser, ReadSessionDep
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.roles import project_filter
from torchyard.api.schemas import Progress
from torchyard.api.streams import guarded_stream
from torchyard.api.ui_feed import JobChanges
from torchyard.api.views import owner_reason
from torchyard.contracts.states import JobState
from torchyard.store.jobs import get_job
from torchyard.store.states import STATES
from torchyard.store.uijobs import (
    FILTER_OPS,
    TABLE_METRICS,
    TableView,
    feed_head,
    page_metric_names,
    state_counts,
    table_page,
)

router = APIRouter(prefix="/v1/ui", tags=["dashboard"])

PING_S = 15.0
MAX_OFFSET = 1_000_000
# The table's metric columns, sort and filters. A name is checked as torchyard/job.py's
# METRIC_NAME (job.log refuses any other), then travels as a bound parameter only.
METRIC_NAME_RE = re.compile(r"[a-z0-9_./-]{1,100}")
PARAM_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # contracts/spec.py's
MAX_METRIC_COLUMNS = 8
MAX_FILTERS = 4
NUMBER_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,3})?")
SORT_HELP = "created_at[:asc|desc], metric:<name>[:asc|desc] or param:<name>[:asc|desc]"
METRIC_HELP = (
    f"metric columns, at most {MAX_METRIC_COLUMNS} (repeated or comma-separated); "
    "train/loss and val/accuracy when absent"
)
FILTER_HELP = "metric:<name>:<gt|ge|lt|le>:<number>, e.g. metric:val/accuracy:gt:0.9"


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
    latest: dict[str, float | None] = Field(description="the latest value of each metric column (`metric`), when recorded")  # fmt: skip
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
    metric_names: list[str] = Field(
        default=[], description="the metric names the page's jobs have (the columns to choose)"
    )


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _row(r: dict[str, Any]) -> TableRow:
    progress = r["progress"] if isinstance(r["progress"], dict) else None
    reason = owner_reason(r["pending_reason"], r["id"], r["owner"])  # api/views.py
    return TableRow.model_validate(
        {**r, "progress": progress, "latest": {k: _finite(v) for k, v in r["latest"].items()},
         "pending_reason": reason, "pruned": bool(r["pruned"]), "params": r["params"] or {}}
    )  # fmt: skip


@router.get(
    "/jobs",
    response_model=TablePage,
    summary="The dashboard's jobs table",
    description="Newest first unless `sort` says; admins see every user's jobs. `q` matches "
    "the name, the start of the id, and for admins the owner; `tag` keeps the jobs with that "
    "tag; `metric` names the metric columns (their latest values in `latest`); `filter` keeps "
    "the jobs whose latest value of a metric passes."
    " `project` keeps one project's jobs (404 unless the caller has a role in it).",
    responses=responses(401, 404, 422, 503),
)
def jobs_table(
    user: CurrentUser,
    session: ReadSessionDep,
    state: Annotated[list[str] | None, Query()] = None,
    q: Annotated[str | None, Query(max_length=200)] = None,
    tag: Annotated[str | None, Query(max_length=64)] = None,
    project: Annotated[str | None, Query(max_length=101)] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    metric: Annotated[list[str] | None, Query(description=METRIC_HELP)] = None,
    sort: Annotated[str | None, Query(max_length=200, description=SORT_HELP)] = None,
    filter: Annotated[
        list[str] | None, Query(description=f"at most {MAX_FILTERS}, all kept: {FILTER_HELP}")
    ] = None,
) -> TablePage:
    states = [s.strip() for v in state or [] for s in v.split(",") if s.strip()]
    bad = [s for s in states if s not in STATES]
    if bad:
        raise validation_error([("state", f"unknown state(s) {bad}; one of {list(STATES)}")])
    text = (q or "").strip() or None
    tag = (tag or "").strip() or None
    project_id = project_filter(session, user, project)  # 404 as GET /v1/jobs?project=
    view = table_view(metric, sort, filter or [])
    counts = state_counts(session, user.viewer, text, tag, view=view, project_id=project_id)
    total = sum(n for s, n in counts.items() if not states or s in states)
    rows = table_page(
        session, user.viewer, states=states, text=text, tag=tag, offset=offset, limit=limit,
        view=view, project_id=project_id,
    )  # fmt: skip
    names = page_metric_names(session, [r["id"] for r in rows])
    return TablePage(items=[_row(r) for r in rows], total=total, counts=counts, metric_names=names)  # fmt: skip


def table_view(metric: list[str] | None, sort: str | None, filters: list[str]) -> TableView:
    """The table's metric columns, sort and filters from the query, or 422 naming the field."""
    if metric is None:
        names: list[str] = list(TABLE_METRICS)
    else:
        names = list(dict.fromkeys(n.strip() for v in metric for n in v.split(",") if n.strip()))
    if len(names) > MAX_METRIC_COLUMNS:
        raise validation_error([("metric", f"at most {MAX_METRIC_COLUMNS} metric columns")])
    if bad := [n for n in names if not METRIC_NAME_RE.fullmatch(n)]:
        raise validation_error([("metric", f"not a metric name: {bad[0][:100]!r} (a-z 0-9 _ . / -, at most 100)")])  # fmt: skip
    if len(filters) > MAX_FILTERS:
        raise validation_error([("filter", f"at most {MAX_FILTERS} filters")])
    return TableView(names, _sort(sort), [_filter(f) for f in filters])


def _sort(given: str | None) -> tuple[str, str, bool] | None:
    if not given:
        return None
    kind, _, rest = given.partition(":")
    if kind == "created_at":
        name, way = "", rest or "desc"
    else:
        name, colon, way = rest.rpartition(":")
        if not colon:
            name, way = rest, "desc"
    pattern = {"metric": METRIC_NAME_RE, "param": PARAM_NAME_RE}.get(kind)
    ok = kind == "created_at" or (pattern is not None and pattern.fullmatch(name) is not None)
    if not ok or way not in ("asc", "desc"):
        raise validation_error([("sort", f"must be {SORT_HELP}")])
    return (kind, name, way == "desc")


def _filter(given: str) -> tuple[str, str, float]:
    kind, name, op, number = [*given.split(":", 3), "", "", ""][:4]
    if kind != "metric" or not METRIC_NAME_RE.fullmatch(name) or op not in FILTER_OPS:
        raise validation_error([("filter", f"must be {FILTER_HELP}")])
    if not NUMBER_RE.fullmatch(number) or not math.isfinite(float(number)):
        raise validation_error([("filter", f"{number[:50]!r} is not a finite number")])
    return (name, op, float(number))


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
