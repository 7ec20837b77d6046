"""What a job feeds while it runs: loss curves and its log (read from storage by byte
range; live events: job_events)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.schemas import LogChunk, MetricsOut, Series
from torchyard.api.views import etag, etag_matches
from torchyard.storage import UnsafePath, job_key, storage_for
from torchyard.store.jobs import get_job, job_version
from torchyard.store.metrics import query_page, query_series
from torchyard.store.paths import LOG_FILE, rank_log_file
from torchyard.store.states import TERMINAL

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["job data"])

MAX_POINTS_LIMIT = 10_000


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
        "TORCHYARD_METRICS_PAGE_POINTS per curve: follow `next_after_step` as `after_step`. "
        "Answers with an `ETag` (for these parameters); with `If-None-Match` naming it, "
        "curves unchanged since are 304 with no body."
    ),
    responses={
        304: {"description": "not modified since If-None-Match"},
        **responses(401, 404, 422, 503),
    },
)
def get_metrics(
    job_id: str,
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
    wanted = list(dict.fromkeys(names)) or None
    # The body depends on the job's version and on every parameter that shapes it.
    page = settings.metrics_page_points
    bounds = {"min_step": min_step, "max_step": max_step}
    tag = etag(job_id, version, wanted, after_step, max_points, page, min_step, max_step)
    validators = {"ETag": tag, "Cache-Control": "no-cache"}
    response.headers.update(validators)
    if etag_matches(if_none_match, tag):
        return Response(status_code=304, headers=validators)
    if max_points is not None:
        series = query_series(
            session, job_id, names=wanted, after_step=after_step, max_points=max_points, **bounds
        )
        return MetricsOut(series={k: Series(**v) for k, v in series.items()})
    # Raw points come in pages: a million-point curve is never one response.
    series, next_after = query_page(
        session, job_id, names=wanted, after_step=after_step, limit=page, **bounds
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
        "each), as text. Follow with `offset = next_offset` until `complete`. `rank`: which "
        "rank's output, for a job of several ranks on an object store (each rank's host ships "
        "its own log; on a shared file system every rank writes the one log, served for any "
        "rank). A log the job replaced with a symbolic link is never followed: 404 "
        "`file_refused`."
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
) -> LogChunk:
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
    try:
        chunk, size = storage.read_range(job_key(job.id, name), offset, limit)
    except (FileNotFoundError, NotADirectoryError):
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
