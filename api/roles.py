"""The role checks of the routes that change a project's jobs and sweeps: what a viewer may
read, a member may also do, and an owner may also manage (store/projects.py). A job the
caller cannot see at all is a 404 before any of these is asked; so is a project a list is
narrowed to (`project_filter`)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from torchyard.api.deps import Principal
from torchyard.api.errors import ApiError, not_found
from torchyard.store.projects import at_least, effective_role, project_named


def require_role(
    session: Session, user: Principal, project_id: int | None, needed: str, doing: str
) -> str:
    """The caller's role in the project, or 403 when it is below `needed` (`doing` says
    what was refused, e.g. "cancel a job")."""
    role = effective_role(session, user.id, user.is_admin, project_id)
    if not at_least(role, needed):
        have = f"a {role}" if role else "not a member"
        raise ApiError(
            403,
            f"you are {have} of this project: to {doing} you need the role {needed} or owner",
            code="forbidden",
        )
    assert role is not None
    return role


def project_filter(session: Session, user: Principal, name: str | None) -> int | None:
    """The id of the project a list is narrowed to (`?project=`: GET /v1/jobs, the
    dashboard's table), or 404 when the caller has no role in it (the same answer whether
    it exists or not); None: no filter."""
    if name is None:
        return None
    project = project_named(session, name)
    if project is None or effective_role(session, user.id, user.is_admin, project.id) is None:
        raise not_found("project")
    return project.id
