"""Changing a job after its submit: tags and notes (PATCH), archive and unarchive, and
deleting an ended job (store/joborg.py does each; this router checks who may, records the
audit entry in the same transaction and answers).

Who may: members and owners of the job's project change tags and notes and archive; owners
delete any ended job of the project, members the ones they submitted; viewers get 403, and
a job the caller cannot see at all is 404, as everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from sqlalchemy.orm import Session

from torchyard.api.deps import CurrentUser, Principal, SessionDep, SettingsDep, actor_of
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.schemas import JobOut
from torchyard.api.views import etag, job_out
from torchyard.storage import storage_for
from torchyard.store.audit import record
from torchyard.store.joborg import (
    JobOrgError,
    archive,
    check_deletable,
    delete_job,
    lock,
    may_delete,
    may_edit,
    normalise_notes,
    normalise_tags,
    set_notes,
    set_tags,
    unarchive,
)
from torchyard.store.jobs import get_job, job_snapshot
from torchyard.store.models import Job
from torchyard.store.projects import effective_role

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

EDITABLE = ("tags", "notes")
EDIT_BODY = {
    "requestBody": {
        "required": True,
        "description": "the fields to change; a field left out is left as it is",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "tags": {
                            "type": "array",
                            "maxItems": 32,
                            "items": {"type": "string", "pattern": "^[A-Za-z0-9_.:/=+-]{1,64}$"},
                            "description": "the job's whole new list (duplicates dropped)",
                        },
                        "notes": {
                            "type": ["string", "null"],
                            "maxLength": 10000,
                            "description": "free text; empty or null clears it",
                        },
                    },
                }
            }
        },
    }
}
Allowed = Callable[[str | None, Job, Principal], bool]


def _can_edit(role: str | None, _job: Job, _user: Principal) -> bool:
    return may_edit(role)


def _can_delete(role: str | None, job: Job, user: Principal) -> bool:
    return may_delete(role, job, user.id)


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The store's refusals as the API's error shape."""
    try:
        yield
    except JobOrgError as e:
        if e.status == 422:
            raise validation_error([(e.field or "body", e.message)]) from None
        raise ApiError(e.status, e.message, code=e.code) from None


def _job_for(
    session: Session, user: Principal, job_id: str, allowed: Allowed, refusal: str
) -> tuple[Job, str]:
    """The job (locked) and its owner's name: 404 when the caller cannot see it, 403 when
    they may see it but not do this."""
    found = get_job(session, user.viewer, job_id)
    if found is None:
        raise not_found()
    job, owner = found
    role = effective_role(session, user.id, user.is_admin, job.project_id)
    if not allowed(role, job, user):
        raise ApiError(403, refusal, code="forbidden")
    return lock(session, job), owner


def _answer(session: Session, user: Principal, job_id: str, response: Response) -> JobOut:
    """The job as GET /v1/jobs/{id} shows it, with the ETag a GET would send now."""
    row = job_snapshot(session, user.viewer, job_id)
    if row is None:  # deleted in between: the answer a GET would give
        raise not_found()
    response.headers["ETag"] = etag(job_id, row["version"])
    response.headers["Cache-Control"] = "no-cache"
    return job_out(row)


def _problems(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of a PATCH body at once: unknown fields, bad tags, bad notes."""
    problems = [
        (k, f"unknown field; a job's editable fields are {', '.join(EDITABLE)}")
        for k in body
        if k not in EDITABLE
    ]
    checks = (("tags", normalise_tags), ("notes", normalise_notes))
    for field, check in checks:
        if field in body:
            try:
                check(body[field])
            except JobOrgError as e:
                problems.append((e.field or field, e.message))
    return problems


_EDIT_REFUSED = "only members and owners of the job's project may change it"


@router.patch(
    "/{job_id}",
    response_model=JobOut,
    summary="Change a job's tags or notes",
    description="`tags`: the whole new list (at most 32, each 1 to 64 letters, digits or "
    "`_ . : / = + -`; duplicates dropped); `notes`: free text up to 10,000 characters (empty "
    "or null clears). Fields left out stay as they are; an unknown field or a bad value is "
    "422 naming it and nothing changes. Members and owners of the job's project may; "
    "viewers get 403. Answers with the job (and its new ETag).",
    responses=responses(401, 403, 404, 422, 503),
    openapi_extra=EDIT_BODY,
)
def edit_job(
    job_id: str,
    body: Annotated[dict[str, Any], Body()],
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
) -> JobOut:
    problems = _problems(body)
    if problems:
        raise validation_error(problems)
    job, _ = _job_for(session, user, job_id, _can_edit, _EDIT_REFUSED)
    changes: dict[str, Any] = {}
    if "tags" in body:
        before, after = set_tags(session, job, body["tags"])
        if before != after:
            changes["tags"] = {"before": before, "after": after}
    if "notes" in body:
        old, new = set_notes(session, job, body["notes"])
        if old != new:
            changes["notes"] = {"before": old, "after": new}
    if changes:
        actor = actor_of(request, user)
        record(session, actor, "job.update", f"job:{job.id}", changes, project_id=job.project_id)
    session.commit()
    return _answer(session, user, job_id, response)


def _archive_route(
    job_id: str, request: Request, response: Response, user: Principal, session: Session, on: bool
) -> JobOut:
    job, _ = _job_for(session, user, job_id, _can_edit, _EDIT_REFUSED)
    if (archive if on else unarchive)(session, job):
        action = "job.archive" if on else "job.unarchive"
        details = {"name": job.name}
        record(session, actor_of(request, user), action, f"job:{job.id}", details, project_id=job.project_id)  # fmt: skip
    session.commit()
    return _answer(session, user, job_id, response)


@router.post(
    "/{job_id}/archive",
    response_model=JobOut,
    summary="Archive a job",
    description="Hides the job from default lists (`GET /v1/jobs?archived=true` shows "
    "archived ones); nothing is deleted and the job may be running. Idempotent. Members and "
    "owners of the job's project may.",
    responses=responses(401, 403, 404, 503),
)
def archive_job(
    job_id: str, request: Request, response: Response, user: CurrentUser, session: SessionDep
) -> JobOut:
    return _archive_route(job_id, request, response, user, session, on=True)


@router.post(
    "/{job_id}/unarchive",
    response_model=JobOut,
    summary="Unarchive a job",
    description="Shows an archived job in default lists again. Idempotent.",
    responses=responses(401, 403, 404, 503),
)
def unarchive_job(
    job_id: str, request: Request, response: Response, user: CurrentUser, session: SessionDep
) -> JobOut:
    return _archive_route(job_id, request, response, user, session, on=False)


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    summary="Delete an ended job",
    description="Removes the job's rows (attempts, events, metrics, checkpoints, tags) and "
    "then its stored files; a sweep trial keeps its values and outcome without the job. The "
    "audit trail keeps its entries. Only for a job that has ended (409 otherwise: cancel it "
    "first). The project's owners may delete any of its jobs, members the ones they "
    "submitted; others get 403.",
    responses=responses(401, 403, 404, 409, 503),
)
def delete_job_route(
    job_id: str, request: Request, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> Response:
    refusal = "only the project's owners, or the member who submitted it, may delete a job"
    job, owner = _job_for(session, user, job_id, _can_delete, refusal)
    with _refusals():
        check_deletable(session, job)
        details = {"name": job.name, "state": job.state, "owner": owner}
        actor = actor_of(request, user)
        record(session, actor, "job.delete", f"job:{job.id}", details, project_id=job.project_id)
        delete_job(session, storage_for(settings), job)  # commits the entry with the rows
    return Response(status_code=204)
