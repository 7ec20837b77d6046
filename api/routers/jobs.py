"""Submit, list, show and cancel jobs. A submit is the submit service's (scheduler/submit.py:
every rule, the store); this router reads the body, answers and wakes the scheduler."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Header, Query, Request, Response
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import (
    CurrentUser,
    Principal,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    actor_of,
    read_engine,
)
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.jsonlimits import decode_body
from torchyard.api.lanes import run_checks
from torchyard.api.roles import project_filter, require_role
from torchyard.api.schemas import JobList, JobOut, SpecWarning, SubmittedJob
from torchyard.api.views import etag, etag_matches, job_out, job_summary
from torchyard.broker import app as broker
from torchyard.contracts.spec import JOB_ID_RE, MAX_PARAM_STR, PARAM_NAME_RE
from torchyard.scheduler import submit
from torchyard.settings import Settings
from torchyard.store.asyncreads import AsyncReads
from torchyard.store.audit import Actor, record
from torchyard.store.bundles import touch_bundles
from torchyard.store.jobs import (
    BadCursor,
    JobFilter,
    get_job,
    job_snapshot,
    job_version,
    list_jobs,
    param_texts,
    pruned_jobs,
    request_cancel,
)
from torchyard.store.models import Job
from torchyard.store.states import STATES

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
MAX_PARAM_FILTERS = 8  # ?param= filters of one list

SUBMIT_BODY = {
    "requestBody": {
        "required": True,
        "description": "a job spec (v1); only model, data and optimizer are required",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
    }
}


def _submit(
    sessions: tuple[sessionmaker[Session], sessionmaker[Session]],
    settings: Settings,
    user: Principal,
    raw: bytes,
    key: str | None,
    actor: Actor,
    rerun_of: str | None = None,
) -> tuple[SubmittedJob, bool]:
    """The submit service (scheduler/submit.py) in one worker-thread hop: the body decoded
    (its depth bounded), checked on a read session (a reference lookup never takes SQLite's
    write lock), stored on a write session, its warnings read after the commit. Returns the
    answer and whether the scheduler must be woken; a refusal (SubmitRefused) is answered by
    api/errors.py."""
    obj = decode_body(raw, settings.max_json_depth, "spec")
    read_sessions, write_sessions = sessions
    with read_sessions() as reads:
        admitted = submit.Admission(reads, settings, user).admit(obj)
        if rerun_of is not None and get_job(reads, user.viewer, rerun_of) is None:
            raise validation_error([("rerun_of", f"no job {rerun_of} that you can see")])
    with write_sessions() as session:
        done = submit.enqueue(session, admitted, key=key, rerun_of=rerun_of)
        if done.created and done.spec.code is not None:
            touch_bundles(session, [done.spec.code.bundle])  # used: kept past the retention
        if done.created:  # a replay of an Idempotency-Key stored nothing
            _record_job(session, actor, "job.submit", done.job)
        session.commit()
        out = _snapshot_out(session, user, done.job.id)
        warnings = submit.warnings(session, settings, done.spec)
    body = SubmittedJob(
        **dict(out), warnings=[SpecWarning(field=f, message=m) for f, m in warnings]
    )
    return body, done.wake


def _record_job(session: Session, actor: Actor, action: str, job: Job, **details: Any) -> None:
    """An audit entry for a change of `job`, in the caller's transaction."""
    details = {"name": job.name, "project_id": job.project_id, **details}
    record(session, actor, action, f"job:{job.id}", details, project_id=job.project_id)


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
    rerun_of: Annotated[
        str | None,
        Query(pattern=JOB_ID_RE, description="the job this one re-runs (`torchyard rerun`)"),
    ] = None,
) -> SubmittedJob:
    raw = await request.body()
    state = request.app.state  # read now: tests swap the sessions
    sessions = (state.read_sessions, state.sessions)
    # Decoding and checking the spec are CPU work bounded by the body's size (and a model
    # build's bounds): off the event loop, with the store calls, in one hop to the checks'
    # own threads (api/lanes.py), never the ones serving reads.
    job, wake = await run_checks(
        request, user.id,
        _submit, sessions, settings, user, raw, idempotency_key, actor_of(request, user), rerun_of,
    )  # fmt: skip
    if wake:
        background.add_task(broker.wake_scheduler, settings)
    else:  # the job first stored with this Idempotency-Key
        response.status_code = 200
    return job


@router.get(
    "",
    response_model=JobList,
    summary="List jobs",
    description="Newest first: the jobs of every project the caller has a role in (admins: "
    "every job), archived ones left out unless `archived` says otherwise. Follow "
    "`next_cursor` for more. `project` names a project the caller has a role in (404 "
    "otherwise).",
    responses=responses(401, 404, 422, 503),
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
    project: Annotated[
        str | None, Query(max_length=101, description="only this project's jobs")
    ] = None,
    tag: Annotated[str | None, Query(max_length=64, description="only jobs with this tag")] = None,
    archived: Annotated[
        Literal["false", "true", "any"],
        Query(description="archived jobs: left out (default), only them, or both"),
    ] = "false",
    param: Annotated[
        list[str] | None,
        Query(
            description="only jobs whose spec's `params` has this value: `name:value` (`lr:0.1`, "
            "`arch:wide`; a number matches 3 and 3.0); repeat for several (all must match), "
            f"at most {MAX_PARAM_FILTERS}"
        ),
    ] = None,
) -> JobList:
    states = [s.strip() for v in state or [] for s in v.split(",") if s.strip()]
    bad = [s for s in states if s not in STATES]
    if bad:
        raise validation_error([("state", f"unknown state(s) {bad}; one of {list(STATES)}")])
    only = JobFilter(
        states=states,
        project_id=project_filter(session, user, project),
        tag=tag,
        archived=None if archived == "any" else archived == "true",
        params=_param_filters(param or []),
    )
    try:
        page, next_cursor = list_jobs(session, user.viewer, cursor=cursor, limit=limit, only=only)
    except BadCursor as e:
        raise validation_error([("cursor", str(e))]) from None
    pruned = pruned_jobs(session, [j.id for j, _, _ in page])
    items = [job_summary(j, owner, proj, j.id in pruned) for j, owner, proj in page]
    return JobList(items=items, next_cursor=next_cursor)


def _param_filters(given: list[str]) -> list[tuple[str, list[str]]]:
    """`?param=name:value` filters as (name, the JSON texts its value may have), or 422
    naming `param`."""
    if len(given) > MAX_PARAM_FILTERS:
        raise validation_error([("param", f"at most {MAX_PARAM_FILTERS} filters")])
    out = []
    for p in given:
        name, colon, value = p.partition(":")
        if not colon or not PARAM_NAME_RE.fullmatch(name):
            raise validation_error([("param", "must be name:value, the name an identifier "
                                     "of up to 64 characters (e.g. lr:0.1)")])  # fmt: skip
        if len(value) > MAX_PARAM_STR:
            raise validation_error([("param", f"a value is at most {MAX_PARAM_STR} characters")])
        out.append((name, param_texts(value)))
    return out


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
    "already succeeded or failed. Needs the role member or owner in the job's project "
    "(a viewer gets 403).",
    responses=responses(401, 403, 404, 409, 503),
)
def cancel_job(
    job_id: str,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> JobOut:
    found = get_job(session, user.viewer, job_id)
    if found is None:
        raise not_found()
    job = found[0]
    require_role(session, user, job.project_id, "member", "cancel a job")
    before = job.state
    request_cancel(session, job)
    if job.state != before:  # a cancel of a cancelled job changed nothing
        _record_job(session, actor_of(request, user), "job.cancel", job, state=before)
    session.commit()
    if job.state != before:
        background.add_task(broker.wake_scheduler, settings)
    return _snapshot_out(session, user, job_id)
