"""The audit trail: who changed what, when, from where.

`record` adds an entry to the caller's session, so it commits (or rolls back) with the
change it describes: a refused request leaves none, and a crash between the change and
the response leaves both or neither. Entries are append-only: the table's triggers
(migration 0016) refuse UPDATE and DELETE, and nothing here offers either.

`list_entries` reads the trail for `GET /v1/audit`: admins read all of it, a project's
owners the entries of their projects.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from torchyard.store.jobs import MAX_PAGE, BadCursor, decode_cursor, encode_cursor
from torchyard.store.models import AuditEntry, ProjectMember, utcnow

MAX_TARGET = 300


@dataclass(frozen=True)
class Actor:
    """Who makes a change: the user (id and name) and the client address they came from."""

    user_id: int | None
    name: str
    client: str | None = None


def record(
    session: Session,
    actor: Actor,
    action: str,
    target: str,
    details: dict[str, Any] | None = None,
    project_id: int | None = None,
) -> None:
    """Add one entry in the caller's transaction. `action` is a dotted verb such as
    `job.cancel`; `target` names the object (`job:<id>`, `project:<name>`, `token:<id>`);
    `project_id` the project it belongs to, for that project's owners."""
    session.add(
        AuditEntry(
            time=utcnow(),
            user_id=actor.user_id,
            user_name=actor.name[:100],
            action=action,
            target=target[:MAX_TARGET],
            project_id=project_id,
            details=details or {},
            client=(actor.client or None) and actor.client[:100],
        )
    )


@dataclass(frozen=True)
class AuditFilter:
    """What `GET /v1/audit` narrows the trail to; None: any. `action` ending in `.` is a
    prefix (`job.`: every job change), else exact; `since` inclusive, `until` exclusive."""

    user: str | None = None
    action: str | None = None
    target: str | None = None
    project_id: int | None = None
    since: datetime | None = None
    until: datetime | None = None


def owned_projects(user_id: int) -> Select[int]:
    """The ids of the projects `user_id` owns: the part of the trail they may read."""
    return select(ProjectMember.project_id).where(
        ProjectMember.user_id == user_id, ProjectMember.role == "owner"
    )


def _where(stmt: Select[AuditEntry], f: AuditFilter) -> Select[AuditEntry]:
    if f.user is not None:
        stmt = stmt.where(AuditEntry.user_name == f.user)
    if f.action is not None and f.action.endswith("."):
        escaped = f.action.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(AuditEntry.action.like(escaped + "%", escape="\\"))
    elif f.action is not None:
        stmt = stmt.where(AuditEntry.action == f.action)
    if f.target is not None:
        stmt = stmt.where(AuditEntry.target == f.target)
    if f.project_id is not None:
        stmt = stmt.where(AuditEntry.project_id == f.project_id)
    if f.since is not None:
        stmt = stmt.where(AuditEntry.time >= f.since)
    if f.until is not None:
        stmt = stmt.where(AuditEntry.time < f.until)
    return stmt


def _cursor_id(cursor: str) -> int:
    """The id a cursor resumes below (BadCursor for one this server did not hand out)."""
    _, raw = decode_cursor(cursor)
    if not raw.isdigit():
        raise BadCursor("not a cursor from this server")
    return int(raw)


def list_entries(
    session: Session,
    *,
    viewer_user_id: int,
    is_admin: bool,
    user: str | None = None,
    action: str | None = None,
    target: str | None = None,
    project_id: int | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[AuditEntry], str | None]:
    """A page of entries, newest first (by id: the order they were written in), and the
    next page's cursor (None: none); the filters are AuditFilter's. Admins read every
    entry; anyone else only those of the projects they own, so a user who owns none gets an
    empty page (not a refusal). BadCursor for a cursor this server did not hand out."""
    where = AuditFilter(user, action, target, project_id, since, until)
    limit = max(1, min(limit, MAX_PAGE))
    stmt = _where(select(AuditEntry), where)
    if not is_admin:
        stmt = stmt.where(AuditEntry.project_id.in_(owned_projects(viewer_user_id)))
    if cursor:
        stmt = stmt.where(AuditEntry.id < _cursor_id(cursor))
    rows = list(session.scalars(stmt.order_by(AuditEntry.id.desc()).limit(limit + 1)))
    page = rows[:limit]
    if len(rows) <= limit:
        return page, None
    # The jobs' cursor format (a time and a key), so every list pages alike.
    return page, encode_cursor(page[-1].time, str(page[-1].id))


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """An entry's details for a change of fields: {"before": …, "after": …} of the fields
    whose value differs; None when none does (a change to the same values is no change)."""
    keys = [k for k in after if before.get(k) != after[k]]
    if not keys:
        return None
    return {"before": {k: before.get(k) for k in keys}, "after": {k: after[k] for k in keys}}
