"""Submit, list, show and cancel jobs."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request, Response
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api import codechecks
from torchyard.api.deps import (
    CurrentUser,
    Principal,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    read_engine,
)
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.schemas import JobList, JobOut, SpecWarning, SubmittedJob
from torchyard.api.views import etag, etag_matches, job_out, job_summary
from torchyard.broker import app as broker
from torchyard.contracts import datasets
from torchyard.contracts import spec as job_spec
from torchyard.scheduler.policy import Kind, describe_kind, kind_of
from torchyard.settings import Settings
from torchyard.store.asyncreads import AsyncReads
from torchyard.store.jobs import (
    BadCursor,
    IdempotencyConflict,
    create_job,
    get_job,
    idempotency_key_used,
    job_snapshot,
    job_version,
    list_jobs,
    request_cancel,
)
from torchyard.store.models import User
from torchyard.store.queue import live_counts
from torchyard.store.quotas import over_max_queued
from torchyard.store.states import STATES
from torchyard.store.workers import stale_cutoff

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

SUBMIT_BODY = {
    "requestBody": {
        "required": True,
        "description": "a job spec (v1); only model, data and optimizer are required",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
    }
}


Problems = list[tuple[str, str]]


def check_spec(obj: Any, settings: Settings) -> tuple[job_spec.JobSpec | None, Problems]:
    """A decoded spec checked before anything touches the store: the spec itself and what
    only the server knows, every problem at once. When the spec does not parse, the
    server's checks still run on the fields that are readable (a world_size above
    TORCHYARD_MAX_WORLD_SIZE is reported beside a batch_size it does not divide)."""
    try:
        spec = job_spec.parse_spec(obj)
    except job_spec.SpecError as e:
        named = {f for f, _ in e.problems}
        extra = [(f, m) for f, m in _raw_server_checks(obj, settings) if f not in named]
        return None, e.problems + extra
    return spec, _server_checks(spec, settings)


def _raw_server_checks(obj: Any, settings: Settings) -> Problems:
    """The server's checks of a spec that did not parse, on the fields that have the right
    type (an `entrypoint` job has no data set of torchyard's to look for)."""
    if not isinstance(obj, dict):
        return []
    data = obj.get("data")
    name = data.get("name") if isinstance(data, dict) and "entrypoint" not in obj else None
    world = obj.get("world_size")
    return _place_checks(
        settings,
        name if isinstance(name, str) else None,
        world if isinstance(world, int) and not isinstance(world, bool) else None,
    )


def _place_checks(settings: Settings, data: str | None, world_size: int | None) -> Problems:
    """The data set is on disk; the world size is allowed."""
    problems = []
    missing = [str(p) for p in datasets.missing_dataset_files(data, settings.data)] if data else []
    if missing:
        problems.append(
            (
                "data.name",
                f"data set '{data}' is not on the server; looked for " + ", ".join(missing),
            )
        )
    if world_size is not None and world_size > settings.max_world_size:
        problems.append(
            ("world_size", f"must be <= {settings.max_world_size} (TORCHYARD_MAX_WORLD_SIZE)")
        )
    return problems


def _server_checks(spec: job_spec.JobSpec, settings: Settings) -> Problems:
    """What only the server knows: the data set is on disk, the world size is allowed, the
    model and the data set are within the size limits. (A script job has no `data`: its
    script reads its own.)"""
    problems = _place_checks(settings, spec.data.name if spec.data else None, spec.world_size)
    # Each field has its cap but their product does not: refuse a model or data set too
    # large for the server before it is stored (nothing to clean up, no OOM on a worker).
    problems += datasets.limit_problems(spec, settings.max_model_params, settings.max_data_bytes)
    return problems


def _pool_warnings(session: Session, settings: Settings, world_size: int) -> Problems:
    """A world size no group of live workers of one kind can give now: the job is queued all
    the same (workers may register later) and its pending reason will say why it waits.
    No worker at all for a one-worker job is a pool starting up or scaled to zero: no
    warning."""
    kinds: dict[Kind, int] = {}
    for device, name, count in live_counts(
        session, stale_cutoff(session, settings.heartbeat_timeout_s)
    ):
        k = kind_of(device, name)
        kinds[k] = kinds.get(k, 0) + count
    best = max(kinds.values(), default=0)
    if world_size <= best or (not kinds and world_size == 1):
        return []
    registered = ", ".join(f"{c} {describe_kind(k)}" for k, c in sorted(kinds.items(), key=str))
    if len(kinds) > 1:
        have = f"the largest group of one kind registered now, {best} (a job never mixes CPU "
        have += f"and GPU workers or GPU models; registered: {registered})"
    else:
        have = f"the {best} workers registered now ({registered or 'none'})"
    message = f"{world_size} is more than {have}: the job waits in the queue until enough register"
    return [("world_size", message)]


def _reference_problems(
    factory: sessionmaker[Session], settings: Settings, user: Principal, spec: job_spec.JobSpec
) -> list[tuple[str, str]]:
    with factory() as session:
        return codechecks.reference_problems(session, settings.storage, user, spec)


def _store_job(
    factory: sessionmaker[Session],
    settings: Settings,
    user: Principal,
    spec: job_spec.JobSpec,
    key: str | None,
) -> tuple[SubmittedJob, bool]:
    """Store the job (or find the one stored with `key`) and answer with its warnings: the
    spec's own (batch size) and the pool's (workers registered), read after the commit."""
    with factory() as session:
        _check_max_queued(session, user, key)
        stored = job_spec.spec_to_dict(spec)
        job, created = create_job(
            session, user.id, stored, name=spec.display_name, idempotency_key=key
        )
        session.commit()
        out = _snapshot_out(session, user, job.id)
        warnings = datasets.size_warnings(spec, settings.data)
        warnings += _pool_warnings(session, settings, spec.world_size)
    body = SubmittedJob(
        **dict(out), warnings=[SpecWarning(field=f, message=m) for f, m in warnings]
    )
    return body, created


def _check_max_queued(session: Session, user: Principal, key: str | None) -> None:
    """429 when the user's queued jobs already fill their quota, in the transaction that
    would store the job (over_max_queued locks the user's row, so two submits cannot both
    take the last place). A retry with a used Idempotency-Key stores nothing: not refused
    (read after the lock, so a concurrent first try with that key is seen)."""
    refused = over_max_queued(session, user.id)
    if refused is None or (key is not None and idempotency_key_used(session, user.id, key)):
        return
    owner = session.get(User, user.id)
    # No `message` in the detail: the message says it all, and clients print both.
    limit = owner.max_queued if owner is not None else None
    raise ApiError(
        429, refused, code="quota_exceeded", details=[{"field": "max_queued", "limit": limit}]
    )


def _snapshot_out(session: Session, user: Principal, job_id: str) -> JobOut:
    """The body of a job the caller has just written (and so may see)."""
    row = job_snapshot(session, user.viewer, job_id)
    if row is None:  # deleted in between: the caller gets the same answer as a GET
        raise not_found()
    return job_out(row)


@router.post(
    "",
    status_code=201,
    response_model=SubmittedJob,
    summary="Submit a job",
    description=(
        "Validates the spec (every problem at once, 422), checks the data set is on the "
        "server, the world size is allowed and the model and data set are within the "
        "server's size limits, stores a queued job and wakes the scheduler. The answer's "
        "`warnings` name what is allowed but likely not meant (a world_size above the "
        "workers registered now, a batch_size above the training set): the job is stored. "
        "A job that runs its own code (`code`, `entrypoint`, a `module:function` model or "
        "data set) needs a user allowed to (`token create --can-run-code`; admins are), "
        "else 403; its `code.bundle` must be one the user uploaded (POST /v1/bundles) and "
        "hold `entrypoint.script`, and `init.from_job` must be a job of the user's with the "
        "checkpoint asked for (422 naming the field). "
        "With `Idempotency-Key`: a retry with the same spec returns the original job with "
        "200; the same key with a different spec is 409. A user who already has their "
        "quota's `max_queued` jobs queued gets 429 (code `quota_exceeded`) and nothing is "
        "stored; a retry with a used Idempotency-Key is answered as above, never 429."
    ),
    responses={
        200: {
            "model": SubmittedJob,
            "description": "the job first created with this Idempotency-Key",
        },
        **responses(401, 403, 409, 413, 422, 429, 503),
    },
    openapi_extra=SUBMIT_BODY,
)
async def submit_job(
    request: Request,
    response: Response,
    user: CurrentUser,
    settings: SettingsDep,
    background: BackgroundTasks,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=200,
            description="any client-chosen string; a retry with it returns the same job",
        ),
    ] = None,
) -> SubmittedJob:
    raw = await request.body()
    try:
        obj = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        raise validation_error([("body", f"not valid JSON: {e}")], "spec") from None
    spec, problems = check_spec(obj, settings)
    if spec is None:
        raise validation_error(problems, "spec")
    codechecks.check_code_permission(user, spec)
    codechecks.check_priority_permission(user, spec)
    if codechecks.needs_store(spec):
        problems += await run_in_threadpool(
            _reference_problems, request.app.state.read_sessions, settings, user, spec
        )
    if problems:
        raise validation_error(problems, "spec")
    try:
        job, created = await run_in_threadpool(
            _store_job, request.app.state.sessions, settings, user, spec, idempotency_key
        )
    except IdempotencyConflict as e:
        raise ApiError(
            409, str(e), code="idempotency_conflict", details={"job_id": e.job_id}
        ) from None
    if created:
        background.add_task(broker.wake_scheduler, settings)
    else:
        response.status_code = 200
    return job


@router.get(
    "",
    response_model=JobList,
    summary="List jobs",
    description="Newest first; admins see every user's jobs. Follow `next_cursor` for more.",
    responses=responses(401, 422, 503),
)
def list_jobs_route(
    user: CurrentUser,
    session: ReadSessionDep,
    state: Annotated[
        list[str] | None,
        Query(description="only jobs in these states (repeat, or comma-separated)"),
    ] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobList:
    states = [s.strip() for v in state or [] for s in v.split(",") if s.strip()]
    bad = [s for s in states if s not in STATES]
    if bad:
        raise validation_error([("state", f"unknown state(s) {bad}; one of {list(STATES)}")])
    try:
        page, next_cursor = list_jobs(
            session, user.viewer, states=states, cursor=cursor, limit=limit
        )
    except BadCursor as e:
        raise validation_error([("cursor", str(e))]) from None
    return JobList(items=[job_summary(j, owner) for j, owner in page], next_cursor=next_cursor)


CONDITIONAL = {
    "headers": {
        "ETag": {"description": "strong; send it back as If-None-Match to poll cheaply"},
        "Cache-Control": {"description": "no-cache: revalidate every time"},
    }
}


@router.get(
    "/{job_id}",
    response_model=JobOut,
    summary="Show a job",
    description="State, attempt, progress, pending reason, error, timestamps, "
    "the newest point of every metric, and every attempt. Answers with an `ETag`; with "
    "`If-None-Match` naming it, an unchanged job is 304 with no body (one cheap read).",
    responses={
        200: CONDITIONAL,
        304: {"description": "not modified since the ETag in If-None-Match", **CONDITIONAL},
        **responses(401, 404, 503),
    },
)
async def get_job_route(
    job_id: str,
    request: Request,
    user: CurrentUser,
    if_none_match: Annotated[str | None, Header(max_length=1000)] = None,
) -> Response:
    # The hot read path: one statement (two for a changed conditional poll), serialised
    # once; on PostgreSQL awaited on the event loop (store/asyncreads.py), else in one
    # worker-thread hop.
    reads: AsyncReads | None = request.app.state.async_reads
    if reads is not None:
        found = await _show_async(reads, user, job_id, if_none_match)
    else:
        found = await run_in_threadpool(_show, read_engine(request), user, job_id, if_none_match)
    if found is None:
        raise not_found()
    tag, body = found
    headers = {"ETag": tag, "Cache-Control": "no-cache"}
    if body is None:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


def _show(
    engine: Engine, user: Principal, job_id: str, if_none_match: str | None
) -> tuple[str, bytes | None] | None:
    """(ETag, JSON body, or None when If-None-Match still holds); None: not visible."""
    with engine.connect() as conn:
        if if_none_match is not None:
            version = job_version(conn, user.viewer, job_id)
            if version is None:
                return None
            tag = etag(job_id, version)
            if etag_matches(if_none_match, tag):
                return tag, None
        row = job_snapshot(conn, user.viewer, job_id)
    return _shown(job_id, row)


async def _show_async(
    reads: AsyncReads, user: Principal, job_id: str, if_none_match: str | None
) -> tuple[str, bytes | None] | None:
    """`_show` over the async reads."""
    if if_none_match is not None:
        version = await reads.job_version(user.viewer, job_id)
        if version is None:
            return None
        tag = etag(job_id, version)
        if etag_matches(if_none_match, tag):
            return tag, None
    return _shown(job_id, await reads.job_snapshot(user.viewer, job_id))


def _shown(job_id: str, row: dict[str, Any] | None) -> tuple[str, bytes] | None:
    if row is None:
        return None
    return etag(job_id, row["version"]), job_out(row).model_dump_json().encode()


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobOut,
    summary="Cancel a job",
    description="A queued job is cancelled at once; a starting or running one goes to "
    "`cancelling` and its worker stops the trainer. Idempotent; 409 for a job that has "
    "already succeeded or failed.",
    responses=responses(401, 404, 409, 503),
)
def cancel_job(
    job_id: str,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> JobOut:
    found = get_job(session, user.viewer, job_id)
    if found is None:
        raise not_found()
    job = found[0]
    before = job.state
    request_cancel(session, job)
    session.commit()
    if job.state != before:
        background.add_task(broker.wake_scheduler, settings)
    return _snapshot_out(session, user, job_id)
