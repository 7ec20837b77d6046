"""Projects and their members: who may see and do what with a project's jobs and sweeps
(store/projects.py says what each role may do). Any user may create a project and owns
it; its owners (and admins) manage its members; admins set its quota (store/quotas.py says
how it combines with its users'). A project the caller has no role in is a 404, whether it
exists or not."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Path, Request
from sqlalchemy.orm import Session

from torchyard.api.deps import (
    AdminUser,
    CurrentUser,
    Principal,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    actor_of,
)
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.project_schemas import (
    MemberIn,
    MemberOut,
    ProjectIn,
    ProjectLimits,
    ProjectList,
    ProjectOut,
    ProjectSummary,
    ProjectUsage,
)
from torchyard.api.roles import require_role
from torchyard.api.schemas import ProjectQuotaIn, ProjectQuotaOut
from torchyard.broker import app as broker
from torchyard.settings import Settings
from torchyard.store import projects as proj
from torchyard.store.audit import changed, record
from torchyard.store.auth import user_named
from torchyard.store.dialect import db_now
from torchyard.store.models import Project
from torchyard.store.pool import project_loads
from torchyard.store.quotas import project_quota_of, set_project_quota
from torchyard.store.usage import usage_by_project

router = APIRouter(prefix="/v1/projects", tags=["projects"])

ProjectName = Annotated[str, Path(min_length=1, max_length=101, description="`~<user>`: personal")]
UserName = Annotated[str, Path(min_length=1, max_length=100)]


def _visible(session: Session, user: Principal, name: str) -> tuple[Project, str | None]:
    """The project and the caller's role in it (None: an admin who is no member); 404 when
    the caller has no role in it."""
    project = proj.project_named(session, name)
    if project is None:
        raise not_found("project")
    role = proj.role_of(session, user.id, project.id)
    if role is None and not user.is_admin:
        raise not_found("project")
    return project, role


def _usage(session: Session, settings: Settings, ids: set[int]) -> dict[int, ProjectUsage]:
    """Each project's running and queued jobs, the workers they hold and its decayed usage."""
    loads = project_loads(session, ids)
    hours = usage_by_project(session, db_now(session), settings.fairshare_half_life_s, ids)
    return {
        pid: ProjectUsage(**loads[pid]._asdict(), worker_hours=hours.get(pid, 0.0) / 3600)
        for pid in ids
    }


def _out(session: Session, settings: Settings, project: Project, role: str | None) -> ProjectOut:
    members = [MemberOut(user=u, role=r) for u, r in proj.members_of(session, project.id)]  # type: ignore[arg-type]
    return ProjectOut(
        name=project.name,
        personal=project.personal_of is not None,
        role=role,  # type: ignore[arg-type]
        members=members,
        created_at=project.created_at,
        quota=ProjectLimits(**project_quota_of(project)),
        usage=_usage(session, settings, {project.id})[project.id],
    )


def _refused(e: proj.ProjectError) -> ApiError:
    return ApiError(e.status, e.message, code=e.code)


@router.post(
    "",
    status_code=201,
    response_model=ProjectOut,
    summary="Create a project",
    description="Any user may create a project; they become its owner. 409 if the name is "
    "taken. Personal projects (`~<user>`) are made with their users.",
    responses=responses(401, 409, 422, 503),
)
def create_project_route(
    body: ProjectIn,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
) -> ProjectOut:
    try:
        project = proj.create_project(session, body.name, user.id)
    except proj.ProjectError as e:
        raise _refused(e) from None
    record(session, actor_of(request, user), "project.create", f"project:{project.name}",
           project_id=project.id)  # fmt: skip
    session.commit()
    return _out(session, settings, project, "owner")


@router.get(
    "",
    response_model=ProjectList,
    summary="List projects",
    description="The projects the caller has a role in, by name (admins: every project), "
    "each with its quota and usage: its running and queued jobs, the workers they hold, its "
    "recent worker-hours.",
    responses=responses(401, 503),
)
def list_projects_route(
    user: CurrentUser, session: ReadSessionDep, settings: SettingsDep
) -> ProjectList:
    items = proj.list_projects(session, user.id, user.is_admin)
    usage = _usage(session, settings, {i.id for i in items})
    return ProjectList(
        items=[
            ProjectSummary(
                name=i.name,
                personal=i.personal,
                role=i.role,  # type: ignore[arg-type]
                members=i.members,
                created_at=i.created_at,
                quota=ProjectLimits(
                    max_workers=i.max_workers, max_queued=i.max_queued, share=i.share
                ),
                usage=usage[i.id],
            )
            for i in items
        ]
    )


@router.get(
    "/{name}",
    response_model=ProjectOut,
    summary="Show a project",
    description="Its members and their roles, its quota and usage; any member may read it.",
    responses=responses(401, 404, 503),
)
def get_project_route(
    name: ProjectName, user: CurrentUser, session: ReadSessionDep, settings: SettingsDep
) -> ProjectOut:
    project, role = _visible(session, user, name)
    return _out(session, settings, project, role)


@router.put(
    "/{name}/members/{member}",
    response_model=ProjectOut,
    summary="Give a user a role in a project (owners)",
    description="Adds the user or changes their role. Only the project's owners (and "
    "admins) may; a project keeps at least one owner (409).",
    responses=responses(401, 403, 404, 409, 422, 503),
)
def put_member_route(
    name: ProjectName,
    member: UserName,
    body: MemberIn,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
) -> ProjectOut:
    project, _ = _visible(session, user, name)
    require_role(session, user, project.id, "owner", "manage members")
    target = user_named(session, member)
    if target is None:
        raise not_found(f"user {member!r}")
    try:
        before = proj.set_member(session, project, target, body.role)
    except proj.ProjectError as e:
        raise _refused(e) from None
    if before != body.role:
        details = {"user": member, "role": body.role, "before": before}
        record(session, actor_of(request, user), "project.member.set", f"project:{name}",
               details, project_id=project.id)  # fmt: skip
    session.commit()
    return _out(session, settings, project, proj.role_of(session, user.id, project.id))


@router.delete(
    "/{name}/members/{member}",
    response_model=ProjectOut,
    summary="Take a user out of a project (owners; anyone for themselves)",
    description="Their role goes at once: the project's jobs are then a 404 to them. A "
    "project keeps at least one owner (409). Taking out a user who is no member is no "
    "change (200).",
    responses=responses(401, 403, 404, 409, 503),
)
def delete_member_route(
    name: ProjectName,
    member: UserName,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
) -> ProjectOut:
    project, _ = _visible(session, user, name)
    if member != user.name:
        require_role(session, user, project.id, "owner", "manage members")
    target = user_named(session, member)
    if target is None:
        raise not_found(f"user {member!r}")
    try:
        before = proj.remove_member(session, project, target)
    except proj.ProjectError as e:
        raise _refused(e) from None
    if before is not None:
        record(session, actor_of(request, user), "project.member.remove", f"project:{name}",
               {"user": member, "before": before}, project_id=project.id)  # fmt: skip
    session.commit()
    mine = proj.role_of(session, user.id, project.id)
    if mine is None and not user.is_admin:  # they left: the project is no longer theirs
        return ProjectOut(name=project.name, personal=project.personal_of is not None,
                          role=None, members=[], created_at=project.created_at)  # fmt: skip
    return _out(session, settings, project, mine)


@router.get(
    "/{name}/quota",
    response_model=ProjectQuotaOut,
    summary="Show a project's quota",
    description="`max_workers`, `max_queued` (null: no limit) and the fair-share `share` of "
    "the project, on top of each user's own quota. Any member (any role) and admins may "
    "read it.",
    responses=responses(401, 404, 503),
)
def get_project_quota_route(
    name: ProjectName, user: CurrentUser, session: ReadSessionDep
) -> ProjectQuotaOut:
    project, _ = _visible(session, user, name)
    return ProjectQuotaOut(project=project.name, **project_quota_of(project))


@router.put(
    "/{name}/quota",
    response_model=ProjectQuotaOut,
    summary="Set a project's quota (admins)",
    description="Changes the fields given and answers with the whole quota; each holds on "
    "top of the users' own. `max_workers`: a job of the project starts only if the "
    "workers all the project's jobs hold, plus its own, stay within it (and within its "
    "user's; the pending reason names the limit that holds it); `max_queued`: a submit "
    "into the project while it has that many queued jobs is 429; both are integers >= 0, "
    "null removes the limit. `share` (> 0; null: back to 1) weighs the project in fair "
    "share: projects go first by usage over share, then their users by theirs. A personal "
    "project's share is its user's (422: set the user's quota). Unknown fields are 422.",
    responses=responses(401, 403, 404, 422, 503),
)
def put_project_quota_route(
    name: ProjectName,
    body: ProjectQuotaIn,
    request: Request,
    user: AdminUser,
    session: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> ProjectQuotaOut:
    project = proj.project_named(session, name)
    if project is None:
        raise not_found("project")
    changes = body.model_dump(include=body.model_fields_set)
    before = project_quota_of(project)
    try:
        after = set_project_quota(session, project, changes)
    except ValueError as e:
        raise validation_error([("body.share", str(e))]) from None
    details = changed(before, after)
    if details is not None:  # fields set to the values they had are no change
        record(session, actor_of(request, user), "project.quota", f"project:{name}", details,
               project_id=project.id)  # fmt: skip
    session.commit()
    if changes:  # a raised max_workers or share may let a waiting job start
        background.add_task(broker.wake_scheduler, settings)
    return ProjectQuotaOut(project=project.name, **after)
