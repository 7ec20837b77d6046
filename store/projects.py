"""Projects: who may see and do what with which jobs and sweeps.

Every job and sweep belongs to one project. A user's role in a project is viewer (sees its
jobs, metrics, logs, checkpoints and sweeps), member (also submits, cancels, tags and
re-runs) or owner (also manages members and deletes any of its jobs). Admins act as owners
everywhere. Every user has a personal project `~<name>`, made with the user and owned by
them: a spec without `project` lands there.

Visibility is one subquery, `visible_projects`, read in the same statement as the rows it
guards: a role given or taken is seen by the very next request, in every API process,
without a cache to expire.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ScalarSelect, bindparam, delete, func, select
from sqlalchemy.orm import Session

from torchyard.store.models import Job, Project, ProjectMember, User, utcnow

ROLES = ("viewer", "member", "owner")
RANK = {role: i for i, role in enumerate(ROLES)}
PERSONAL_PREFIX = "~"
# A team project's name: what fits a URL path segment and a shell word unquoted.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class ProjectError(Exception):
    """A refused change: `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, code: str = "invalid"):
        self.status, self.message, self.code = status, message, code
        super().__init__(message)


def personal_name(user_name: str) -> str:
    return PERSONAL_PREFIX + user_name


def at_least(role: str | None, needed: str) -> bool:
    return role is not None and RANK[role] >= RANK[needed]


def visible_projects(user_id: Any) -> ScalarSelect[int]:
    """The ids of the projects `user_id` (a value or a bind parameter) has any role in."""
    return (
        select(ProjectMember.project_id).where(ProjectMember.user_id == user_id).scalar_subquery()
    )


def visible_projects_param() -> ScalarSelect[int]:
    """`visible_projects` for a statement built once: the user is the `user_id` parameter."""
    return visible_projects(bindparam("user_id"))


def ensure_personal(session: Session, user: User) -> Project:
    """The user's personal project, made (owned by them) if missing."""
    project = session.scalar(select(Project).where(Project.personal_of == user.id))
    if project is None:
        project = Project(name=personal_name(user.name), personal_of=user.id, created_at=utcnow())
        session.add(project)
        session.flush()
        session.add(ProjectMember(project_id=project.id, user_id=user.id, role="owner"))
        session.flush()
    return project


def personal_project_id(session: Session, user_id: int) -> int | None:
    return session.scalar(select(Project.id).where(Project.personal_of == user_id))


def project_named(session: Session, name: str) -> Project | None:
    return session.scalar(select(Project).where(Project.name == name))


def role_of(session: Session, user_id: int, project_id: int) -> str | None:
    """The user's role in the project; None: none."""
    return session.scalar(
        select(ProjectMember.role).where(
            ProjectMember.project_id == project_id, ProjectMember.user_id == user_id
        )
    )


def effective_role(
    session: Session, user_id: int, is_admin: bool, project_id: int | None
) -> str | None:
    """The role the user acts with in the project: admins are owners everywhere."""
    if is_admin:
        return "owner"
    return None if project_id is None else role_of(session, user_id, project_id)


def create_project(session: Session, name: str, owner_id: int) -> Project:
    """A team project, owned by `owner_id` (ProjectError 422 for a bad name, 409 if taken)."""
    if not NAME_RE.match(name):
        raise ProjectError(
            422,
            "a project's name is 1 to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )
    if project_named(session, name) is not None:
        raise ProjectError(409, f"project {name!r} already exists", code="conflict")
    project = Project(name=name, created_at=utcnow())
    session.add(project)
    session.flush()
    session.add(ProjectMember(project_id=project.id, user_id=owner_id, role="owner"))
    session.flush()
    return project


def _owners(session: Session, project_id: int) -> int:
    q = select(func.count()).where(
        ProjectMember.project_id == project_id, ProjectMember.role == "owner"
    )
    return session.scalar(q) or 0


def set_member(session: Session, project: Project, user: User, role: str) -> str | None:
    """Give `user` `role` in the project; returns the role they had (None: none). A
    project keeps at least one owner (ProjectError 409)."""
    if role not in RANK:
        raise ProjectError(422, f"role must be one of {', '.join(ROLES)}")
    row = session.get(ProjectMember, (project.id, user.id), with_for_update=True)
    before = row.role if row is not None else None
    if row is None:
        session.add(ProjectMember(project_id=project.id, user_id=user.id, role=role))
    else:
        if before == "owner" and role != "owner":
            _keep_an_owner(session, project)
        row.role = role
    session.flush()
    return before


def remove_member(session: Session, project: Project, user: User) -> str | None:
    """Take the user out of the project; returns the role they had (None: none)."""
    row = session.get(ProjectMember, (project.id, user.id), with_for_update=True)
    if row is None:
        return None
    if row.role == "owner":
        _keep_an_owner(session, project)
    before = row.role
    session.execute(
        delete(ProjectMember).where(
            ProjectMember.project_id == project.id, ProjectMember.user_id == user.id
        )
    )
    return before


def _keep_an_owner(session: Session, project: Project) -> None:
    # The project's row is locked first, so two owners demoting each other at once
    # cannot both pass the count.
    session.scalar(select(Project.id).where(Project.id == project.id).with_for_update())
    if _owners(session, project.id) <= 1:
        raise ProjectError(
            409, f"project {project.name!r} must keep an owner: add another first", code="conflict"
        )


@dataclass(frozen=True)
class ProjectInfo:
    name: str
    personal: bool
    role: str | None  # the caller's; None for an admin who is no member
    members: int
    created_at: datetime
    id: int
    max_workers: int | None  # its quota (store/quotas.py)
    max_queued: int | None
    share: float


def list_projects(session: Session, user_id: int, is_admin: bool) -> list[ProjectInfo]:
    """The projects the user has a role in (admins: every project), by name."""
    counts = (
        select(ProjectMember.project_id, func.count().label("n"))
        .group_by(ProjectMember.project_id)
        .subquery()
    )
    mine = (
        select(ProjectMember.project_id, ProjectMember.role)
        .where(ProjectMember.user_id == user_id)
        .subquery()
    )
    q = (
        select(Project, mine.c.role, func.coalesce(counts.c.n, 0))
        .outerjoin(mine, mine.c.project_id == Project.id)
        .outerjoin(counts, counts.c.project_id == Project.id)
        .order_by(Project.name)
    )
    if not is_admin:
        q = q.where(mine.c.role.is_not(None))
    return [
        ProjectInfo(
            p.name,
            p.personal_of is not None,
            role,
            n,
            p.created_at,
            p.id,
            p.max_workers,
            p.max_queued,
            float(p.share),
        )
        for p, role, n in session.execute(q)
    ]


def members_of(session: Session, project_id: int) -> list[tuple[str, str]]:
    """(user name, role) of each member, owners first."""
    q = (
        select(User.name, ProjectMember.role)
        .join(User, User.id == ProjectMember.user_id)
        .where(ProjectMember.project_id == project_id)
    )
    rows = [(name, role) for name, role in session.execute(q)]
    return sorted(rows, key=lambda r: (-RANK[r[1]], r[0]))


def project_names(session: Session, ids: set[int]) -> dict[int, str]:
    if not ids:
        return {}
    q = select(Project.id, Project.name).where(Project.id.in_(ids))
    return {pid: name for pid, name in session.execute(q)}


def visible_job_ids(session: Session, user_id: int, job_ids: Iterable[str | None]) -> list[str]:
    """Which of `job_ids` belong to a project the user has a role in (one indexed query)."""
    wanted = [j for j in set(job_ids) if j is not None]
    if not wanted:
        return []
    q = select(Job.id).where(Job.id.in_(wanted), Job.project_id.in_(visible_projects(user_id)))
    return list(session.scalars(q))
