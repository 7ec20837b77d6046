"""What a job feeds while it runs: loss curves (JSON pages, or every point as CSV:
api/metricscsv.py) and its log (read from storage by byte range, or searched:
api/loggrep.py; live events: job_events)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import CurrentUser, Principal
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.lanes import lane
from torchyard.api.loggrep import Line, grep_log, text
from torchyard.api.metricscsv import Selection, csv_lines
from torchyard.api.schemas import LogChunk, LogLine, LogMatch, LogMatches, MetricsOut, Series
from torchyard.api.views import etag, etag_matches
from torchyard.settings import Settings
from torchyard.storage import Storage, UnsafePath, job_key, storage_for
from torchyard.store.jobs import get_job, job_version
from torchyard.store.metrics import metric_names, query_page, query_series
from torchyard.store.models import Job
from torchyard.store.paths import LOG_FILE, rank_log_file
from torchyard.store.states import TERMINAL

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["job data"])

MAX_POINTS_LIMIT = 10_000
MAX_GREP_CONTEXT = 20  # lines before and after a match
MAX_GREP_MATCHES = 1000  # matches one search answers at most

Reader = Callable[[str, int, int], tuple[bytes, int]]


@router.get(
    "/{job_id}/metrics",
    response_model=MetricsOut,
    response_model_exclude_none=True,
    summary="Loss curves",
    description=(
        "`{series: {name: {steps, values}}}`, steps ascending. `name` repeats or is "
        "comma-separated (default: every metric); `after_step` returns only later points "
        "(for polling); `min_step` and `max_step` keep only the points of that step range "
        "(inclusive: a chart's zoom); `max_points` downsamples each curve to at most that many buckets of "
        "steps (of that range), each giving its last point plus the bucket's `min` and `max`, so spikes show. "
        "Without `max_points` the raw points come in pages of at most "
        "TORCHYARD_METRICS_PAGE_POINTS per curve: follow `next_after_step` as `after_step` "
        "(all curves together hold at most TORCHYARD_METRICS_PAGE_TOTAL_POINTS points, or "
        "buckets: past it pages are shorter, or buckets wider, and `capped` is true; "
        "`times=true`: each curve's `times`, Unix seconds, too). `format=csv`: every point "
        "of the selection (no `max_points`) as `text/csv`, one row each (name, step, epoch, "
        "value, time; series by name, then step), streamed, as an attachment named "
        "`<job id>-metrics.csv`. Answers with an `ETag` (for these parameters); with `If-None-Match` naming it, "
        "curves unchanged since are 304 with no body. "
        "System metrics, sampled by the worker, are series too (`name=sys/rss_bytes`): "
        "`sys/cpu_percent` (100 = one core), `sys/rss_bytes` (the trainer's whole process "
        "tree), and on a GPU `sys/gpu_util_percent`, `sys/gpu_memory_bytes`, "
        "`sys/gpu_power_watts`, `sys/gpu_temperature_c`; rank k > 0 of a DDP job as "
        "`sys/rank{k}/<metric>`. They are indexed by time, not by training step: a point's "
        "step is the whole Unix second it was sampled at (so `min_step`/`max_step` are a "
        "time range)."
    ),
    responses={
        200: {"content": {"text/csv": {"schema": {"type": "string"}}}},
        304: {"description": "not modified since If-None-Match"},
        **responses(401, 404, 422, 503),
    },
)
async def get_metrics(
    job_id: str,
    request: Request,
    user: CurrentUser,
    name: Annotated[list[str] | None, Query(description="metric name(s), e.g. train/loss")] = None,
    after_step: Annotated[int | None, Query(ge=-(2**62), le=2**62)] = None,
    max_points: Annotated[int | None, Query(ge=1, le=MAX_POINTS_LIMIT)] = None,
    min_step: Annotated[int | None, Query(ge=-(2**62), le=2**62)] = None,
    max_step: Annotated[int | None, Query(ge=-(2**62), le=2**62)] = None,
    if_none_match: Annotated[str | None, Header(max_length=1000)] = None,
    fmt: Annotated[
        Literal["json", "csv"], Query(alias="format", description="json (default) or csv")
    ] = "json",
    times: Annotated[bool, Query(description="raw pages: each series' `times` too")] = False,
) -> Response:
    names = [n.strip() for v in name or [] for n in v.split(",") if n.strip()]
    too_long = [n for n in names if len(n) > 100]
    if too_long:
        raise validation_error([("name", "metric names are at most 100 characters")])
    if min_step is not None and max_step is not None and min_step > max_step:
        raise validation_error([("max_step", "must be >= min_step")])
    if fmt == "csv" and max_points is not None:
        raise validation_error([("max_points", "not with format=csv: it holds every point")])
    sel = Selection(list(dict.fromkeys(names)) or None, after_step, min_step, max_step)
    ask = MetricsAsk(sel, max_points, fmt, times)
    # A page is up to TORCHYARD_METRICS_PAGE_TOTAL_POINTS: read and serialised on the costly
    # reads' own threads (api/lanes.py), never on the event loop or the store threads.
    sessions, settings = request.app.state.read_sessions, request.app.state.settings
    return await lane(request, "costly_reads").run(
        _metrics, sessions, settings, user, job_id, ask, if_none_match
    )


@dataclass(frozen=True)
class MetricsAsk:
    sel: Selection  # which points (api/metricscsv.py)
    max_points: int | None
    fmt: Literal["json", "csv"]
    times: bool


def _metrics(
    sessions: sessionmaker[Session],
    settings: Settings,
    user: Principal,
    job_id: str,
    ask: MetricsAsk,
    if_none_match: str | None,
) -> Response:
    """The metrics answer, its body serialised here (a thread's work, not the loop's)."""
    with sessions() as session:
        version = job_version(session, user.viewer, job_id)
        if version is None:
            raise not_found()
        # The body depends on the job's version and on every parameter that shapes it.
        page, total = settings.metrics_page_points, settings.metrics_page_total_points
        shape = ("csv",) if ask.fmt == "csv" else ("times",) if ask.times else ()
        sel = ask.sel
        tag = etag(job_id, version, sel.names, sel.after_step, ask.max_points, page, sel.min_step,
                   sel.max_step, *shape, total)  # fmt: skip
        validators = {"ETag": tag, "Cache-Control": "no-cache"}
        if etag_matches(if_none_match, tag):
            return Response(status_code=304, headers=validators)
        if ask.fmt == "csv":
            return _csv_response(sessions, job_id, sel, validators)
        out = _metrics_page(session, job_id, ask, page, total)
    body = out.model_dump_json(exclude_none=True)
    return Response(body, media_type="application/json", headers=validators)


def _metrics_page(
    session: Session, job_id: str, ask: MetricsAsk, page: int, total: int
) -> MetricsOut:
    """Downsampled curves (each at most max_points buckets, all of them at most `total`),
    or one raw page (at most `page` points a curve, `total` in all)."""
    sel = ask.sel
    bounds = {"min_step": sel.min_step, "max_step": sel.max_step}
    if ask.max_points is not None:
        wanted = sel.names or metric_names(session, job_id)
        buckets = min(ask.max_points, max(1, total // max(1, len(wanted))))
        series = query_series(session, job_id, names=wanted, after_step=sel.after_step,
                              max_points=buckets, **bounds)  # fmt: skip
        capped = True if buckets < ask.max_points and wanted else None
        return MetricsOut(series={k: Series(**v) for k, v in series.items()}, capped=capped)
    # Raw points come in pages: a million-point curve is never one response.
    found = query_page(session, job_id, names=sel.names, after_step=sel.after_step, limit=page,
                       total=total, with_time=ask.times, **bounds)  # fmt: skip
    return MetricsOut(
        series={k: Series(**v) for k, v in found.series.items()},
        next_after_step=found.next_after_step,
        capped=found.capped or None,
    )


def _csv_response(
    sessions: sessionmaker[Session], job_id: str, sel: Selection, validators: dict[str, str]
) -> StreamingResponse:
    """Every selected point as CSV, streamed page by page (api/metricscsv.py)."""
    return StreamingResponse(
        csv_lines(sessions, job_id, sel),
        media_type="text/csv; charset=utf-8",
        headers={
            **validators,
            "Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"',
        },
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
    response_model=LogChunk | LogMatches,
    summary="The trainer's output, or a search of it",
    description=(
        "Bytes `offset` to `offset + limit` of the job's log (all attempts, one header line "
        "each), as text. Follow with `offset = next_offset` until `complete`. `rank`: which "
        "rank's output, for a job of several ranks on an object store (each rank's host ships "
        "its own log; on a shared file system every rank writes the one log, served for any "
        "rank). A log the job replaced with a symbolic link is never followed: 404 "
        "`file_refused`.\n\n"
        "With `grep`: the lines holding that fixed string (no regular expression; "
        "`ignore_case`), each with its byte `offset` and `context` lines `before` and "
        "`after`, from `offset` on (`LogMatches`). One request scans at most "
        "TORCHYARD_LOG_GREP_SCAN_BYTES and answers at most `limit_matches` matches (lines cut "
        "at 4 KiB), within TORCHYARD_LOG_GREP_MAX_S seconds (past it, what was found with "
        "`stopped_early`); go on with `offset = next_offset` until `complete` (the end of "
        "the log as it was)."
    ),
    responses=responses(401, 404, 422, 503),
)
async def get_logs(
    job_id: str,
    request: Request,
    user: CurrentUser,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=4 * 1024 * 1024)] = 256 * 1024,
    rank: Annotated[int, Query(ge=0, le=2**20)] = 0,
    grep: Annotated[
        str | None, Query(max_length=1000, description="search for this fixed string")
    ] = None,
    ignore_case: bool = False,
    context: Annotated[int, Query(ge=0, le=MAX_GREP_CONTEXT)] = 2,
    limit_matches: Annotated[int, Query(ge=1, le=MAX_GREP_MATCHES)] = 200,
) -> Response:
    state = request.app.state
    at = LogAt(state.read_sessions, state.settings, user, job_id, rank, offset)
    # Answers of up to 4 MiB: serialised in the thread that reads them, not on the loop.
    if grep is None:
        return await run_in_threadpool(_read_log, at, limit)
    search = GrepAsk(grep, ignore_case, context, limit_matches)
    _check_pattern(search.pattern)
    # A search is bounded in bytes and time, and runs on the costly reads' own threads
    # (api/lanes.py): never holding up the threads that serve other reads.
    return await lane(request, "costly_reads").run(_search_log, at, search)


@dataclass(frozen=True)
class LogAt:
    """Which log, from where, as the user asked for it."""

    sessions: sessionmaker[Session]
    settings: Settings
    user: Principal
    job_id: str
    rank: int
    offset: int

    def find(self) -> tuple[Storage, Job, str]:
        """The storage, the job (404 unless the user sees it) and its (rank's) log's key."""
        storage = storage_for(self.settings)
        with self.sessions() as session:
            found = get_job(session, self.user.viewer, self.job_id)
        if found is None:
            raise not_found()
        job = found[0]
        if self.rank >= job.world_size:
            raise validation_error(
                [("rank", f"the job has {job.world_size} rank(s): 0 to {job.world_size - 1}")]
            )
        name = LOG_FILE if storage.stored_run_dirs else rank_log_file(self.rank)
        return storage, job, job_key(job.id, name)


@contextmanager
def _refusing_links(job: Job) -> Iterator[None]:
    try:
        yield
    except (UnsafePath, PermissionError) as e:
        # The job replaced its log with a link (or made it unreadable): never followed.
        log.warning("refused to serve the log of job %s: %s", job.id, e)
        raise ApiError(
            404,
            f"the job's log ({LOG_FILE}) is refused: it is not a plain file of the job's "
            "directory (a symbolic link?)",
            code="file_refused",
        ) from None


def _json(model: LogChunk | LogMatches) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _read_log(at: LogAt, limit: int) -> Response:
    storage, job, key = at.find()
    terminal = job.state in TERMINAL
    try:
        with _refusing_links(job):
            chunk, size = storage.read_range(key, at.offset, limit)
    except (FileNotFoundError, NotADirectoryError):
        return _json(LogChunk(data="", offset=0, next_offset=0, size=0, complete=terminal))
    start = min(at.offset, size)
    if start + len(chunk) < size:
        chunk = chunk[: _utf8_cut(chunk)]
    end = start + len(chunk)
    return _json(
        LogChunk(
            data=chunk.decode("utf-8", errors="replace"),
            offset=start,
            next_offset=end,
            size=size,
            complete=terminal and end >= size,
        )
    )


def _search_log(at: LogAt, search: GrepAsk) -> Response:
    storage, job, key = at.find()
    bounds = (at.settings.log_grep_scan_bytes, at.settings.log_grep_max_s)
    try:
        with _refusing_links(job):
            return _json(_grep(storage.read_range, key, search, at.offset, *bounds))
    except (FileNotFoundError, NotADirectoryError):
        empty = LogMatches(matches=[], offset=0, next_offset=0, size=0, scanned=0, complete=True)
        return _json(empty)


@dataclass(frozen=True)
class GrepAsk:
    pattern: str
    ignore_case: bool
    context: int
    limit_matches: int


def _check_pattern(pattern: str) -> None:
    """422 for a pattern the search cannot take."""
    if not pattern:
        raise validation_error([("grep", "must not be empty")])
    if "\n" in pattern or "\r" in pattern:
        raise validation_error([("grep", "searches one line: no line break in the pattern")])


def _grep(
    read: Reader, key: str, ask: GrepAsk, offset: int, scan_bytes: int, max_s: float
) -> LogMatches:
    """One search of the log bounded in bytes and time (api/loggrep.py)."""
    found = grep_log(
        lambda start, n: read(key, start, n),
        ask.pattern,
        ignore_case=ask.ignore_case,
        context=ask.context,
        offset=offset,
        limit_matches=ask.limit_matches,
        scan_bytes=scan_bytes,
        max_s=max_s,
    )

    def line(ln: Line) -> LogLine:
        return LogLine(offset=ln.offset, text=text(ln.raw)[0])

    matches = [
        LogMatch(
            offset=m.line.offset,
            text=shown,
            cut=cut,
            before=[line(x) for x in m.before],
            after=[line(x) for x in m.after],
        )
        for m in found.matches
        for shown, cut in [text(m.line.raw)]
    ]
    return LogMatches(
        matches=matches,
        offset=found.offset,
        next_offset=found.next_offset,
        size=found.size,
        scanned=found.scanned,
        complete=found.complete,
        stopped_early=found.stopped_early,
    )
