"""The audit trail over the API: `GET /v1/audit`, newest first, filtered and paged like
`GET /v1/jobs`. Admins read every entry; a project's owners read its entries; anyone else
gets an empty page. Entries are written by the routes that change something
(store/audit.py: `record`, in the change's own transaction) and are never changed or
removed: there is no route to, and the table's triggers refuse it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from torchyard.api.deps import CurrentUser, Principal, ReadSessionDep
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.store.audit import list_entries
from torchyard.store.jobs import BadCursor
from torchyard.store.models import AuditEntry
from torchyard.store.projects import project_named, role_of

router = APIRouter(prefix="/v1/audit", tags=["audit"])


class AuditEntryOut(BaseModel):
    id: int
    time: datetime
    user: str = Field(description="who made the change (`<os user>@local`: the server's CLI)")
    action: str = Field(description="what was done: a dotted verb such as `job.cancel`")
    target: str = Field(description="what it was done to: `job:<id>`, `token:<id>`, …")
    details: dict[str, Any] = Field(description="what changed (before and after values)")
    client: str | None = Field(description="the address the request came from")


class AuditList(BaseModel):
    items: list[AuditEntryOut]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null: none")


def _entry_out(e: AuditEntry) -> AuditEntryOut:
    return AuditEntryOut(
        id=e.id,
        time=e.time,
        user=e.user_name,
        action=e.action,
        target=e.target,
        details=e.details or {},
        client=e.client,
    )


def _utc(t: datetime | None) -> datetime | None:
    """A time without a zone is UTC (as every time torchyard answers with)."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


def _project_id(session: Session, user: Principal, name: str) -> int:
    """The project to read the trail of: 404 unknown (or one the caller has no role in),
    403 for a member who is not an owner."""
    project = project_named(session, name)
    if project is None:
        raise not_found("project")
    if user.is_admin:
        return project.id
    role = role_of(session, user.id, project.id)
    if role is None:
        raise not_found("project")
    if role != "owner":
        raise ApiError(403, "only a project's owners may read its audit trail", code="forbidden")
    return project.id


@router.get(
    "",
    response_model=AuditList,
    summary="Read the audit trail",
    description="Every change a person made (submit, cancel, quota, token, login, sweep, "
    "…), newest first: who, when, what, its target, the details and the client's address. "
    "Admins read every entry; a project's owners the entries of their projects; anyone "
    "else gets no entries. `action` ending in `.` is a prefix (`job.`); `since` is "
    "inclusive, `until` exclusive (ISO 8601; no zone: UTC). Follow `next_cursor` for more.",
    responses=responses(401, 403, 404, 422, 503),
)
def list_audit_route(
    user: CurrentUser,
    session: ReadSessionDep,
    by: Annotated[str | None, Query(alias="user", min_length=1, max_length=100)] = None,
    action: Annotated[str | None, Query(min_length=1, max_length=40)] = None,
    target: Annotated[str | None, Query(min_length=1, max_length=300)] = None,
    project: Annotated[str | None, Query(min_length=1, max_length=101)] = None,
    since: datetime | None = None,
    until: datetime | None = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> AuditList:
    project_id = None if project is None else _project_id(session, user, project)
    try:
        page, next_cursor = list_entries(
            session,
            viewer_user_id=user.id,
            is_admin=user.is_admin,
            user=by,
            action=action,
            target=target,
            project_id=project_id,
            since=_utc(since),
            until=_utc(until),
            cursor=cursor,
            limit=limit,
        )
    except BadCursor as e:
        raise validation_error([("cursor", str(e))]) from None
    return AuditList(items=[_entry_out(e) for e in page], next_cursor=next_cursor)
