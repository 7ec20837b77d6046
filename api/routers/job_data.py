"""What a job feeds while it runs: loss curves (JSON pages, or every point as CSV:
api/metricscsv.py) and its log (read from storage by byte range, or searched:
api/loggrep.py; live events: job_events)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.loggrep import Line, grep_log, text
from torchyard.api.metricscsv import Selection, csv_lines
from torchyard.api.schemas import LogChunk, LogLine, LogMatch, LogMatches, MetricsOut, Series
from torchyard.api.views import etag, etag_matches
from torchyard.storage import UnsafePath, job_key, storage_for
from torchyard.store.jobs import get_job, job_version
from torchyard.store.metrics import query_page, query_series
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
        "(`times=true`: each curve's `times`, Unix seconds, too). `format=csv`: every point "
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
def get_metrics(
    job_id: str,
    request: Request,
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    response: Response,
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
) -> MetricsOut | Response:
    version = job_version(session, user.viewer, job_id)
    if version is None:
        raise not_found()
    names = [n.strip() for v in name or [] for n in v.split(",") if n.strip()]
    too_long = [n for n in names if len(n) > 100]
    if too_long:
        raise validation_error([("name", "metric names are at most 100 characters")])
    if min_step is not None and max_step is not None and min_step > max_step:
        raise validation_error([("max_step", "must be >= min_step")])
    if fmt == "csv" and max_points is not None:
        raise validation_error([("max_points", "not with format=csv: it holds every point")])
    wanted = list(dict.fromkeys(names)) or None
    # The body depends on the job's version and on every parameter that shapes it.
    page = settings.metrics_page_points
    bounds = {"min_step": min_step, "max_step": max_step}
    shape = ("csv",) if fmt == "csv" else ("times",) if times else ()
    tag = etag(job_id, version, wanted, after_step, max_points, page, min_step, max_step, *shape)
    validators = {"ETag": tag, "Cache-Control": "no-cache"}
    response.headers.update(validators)
    if etag_matches(if_none_match, tag):
        return Response(status_code=304, headers=validators)
    if fmt == "csv":
        sel = Selection(wanted, after_step, min_step, max_step)
        return _csv_response(request.app.state.read_sessions, job_id, sel, validators)
    if max_points is not None:
        series = query_series(
            session, job_id, names=wanted, after_step=after_step, max_points=max_points, **bounds
        )
        return MetricsOut(series={k: Series(**v) for k, v in series.items()})
    # Raw points come in pages: a million-point curve is never one response.
    series, next_after = query_page(
        session, job_id, names=wanted, after_step=after_step, limit=page, with_time=times, **bounds
    )
    return MetricsOut(
        series={k: Series(**v) for k, v in series.items()}, next_after_step=next_after
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
        "at 4 KiB); go on with `offset = next_offset` until `complete` (the end of the log "
        "as it was)."
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
    rank: Annotated[int, Query(ge=0, le=2**20)] = 0,
    grep: Annotated[
        str | None, Query(max_length=1000, description="search for this fixed string")
    ] = None,
    ignore_case: bool = False,
    context: Annotated[int, Query(ge=0, le=MAX_GREP_CONTEXT)] = 2,
    limit_matches: Annotated[int, Query(ge=1, le=MAX_GREP_MATCHES)] = 200,
) -> LogChunk | LogMatches:
    found = get_job(session, user.viewer, job_id)
    if found is None:
        raise not_found()
    job = found[0]
    if rank >= job.world_size:
        raise validation_error(
            [("rank", f"the job has {job.world_size} rank(s): 0 to {job.world_size - 1}")]
        )
    terminal = job.state in TERMINAL
    storage = storage_for(settings)
    name = LOG_FILE if storage.stored_run_dirs else rank_log_file(rank)
    key = job_key(job.id, name)
    try:
        if grep is not None:
            search = GrepAsk(grep, ignore_case, context, limit_matches)
            return _grep(storage.read_range, key, search, offset, settings.log_grep_scan_bytes)
        chunk, size = storage.read_range(key, offset, limit)
    except (FileNotFoundError, NotADirectoryError):
        if grep is not None:
            return LogMatches(matches=[], offset=0, next_offset=0, size=0, scanned=0, complete=True)  # fmt: skip
        return LogChunk(data="", offset=0, next_offset=0, size=0, complete=terminal)
    except (UnsafePath, PermissionError) as e:
        # The job replaced its log with a link (or made it unreadable): never followed.
        log.warning("refused to serve the log of job %s: %s", job.id, e)
        raise ApiError(
            404,
            f"the job's log ({LOG_FILE}) is refused: it is not a plain file of the job's "
            "directory (a symbolic link?)",
            code="file_refused",
        ) from None
    start = min(offset, size)
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


@dataclass(frozen=True)
class GrepAsk:
    pattern: str
    ignore_case: bool
    context: int
    limit_matches: int


def _grep(read: Reader, key: str, ask: GrepAsk, offset: int, scan_bytes: int) -> LogMatches:
    """One bounded search of the log (api/loggrep.py); 422 for a pattern it cannot take."""
    if not ask.pattern:
        raise validation_error([("grep", "must not be empty")])
    if "\n" in ask.pattern or "\r" in ask.pattern:
        raise validation_error([("grep", "searches one line: no line break in the pattern")])
    found = grep_log(
        lambda start, n: read(key, start, n),
        ask.pattern,
        ignore_case=ask.ignore_case,
        context=ask.context,
        offset=offset,
        limit_matches=ask.limit_matches,
        scan_bytes=scan_bytes,
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
    )
