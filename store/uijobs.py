"""What the dashboard's jobs table reads: a page of jobs (filtered by state and text, with
the latest values of the metric columns asked for, train/loss and val/accuracy unless
told, and the workers running them; sorted by a metric, a param or age, and filtered by a
metric's latest value: `TableView`), and the changes its live stream announces (which jobs
changed since the last look).

Changes are found without scanning every job: new job events (state changes, submits) by
their id, and the versions of the jobs that are starting, running or cancelling (the only
ones whose progress and curves move), compared with the previous look.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from torchyard.store.dialect import json_member_number, json_member_text
from torchyard.store.feed import FeedCursor
from torchyard.store.jobs import Viewer, pruned_trial
from torchyard.store.metrics import metric_names
from torchyard.store.models import (
    Assignment,
    Attempt,
    Checkpoint,
    Job,
    JobEvent,
    JobTag,
    Metric,
    Project,
    ProjectMember,
    User,
    Worker,
)
from torchyard.store.projects import visible_projects
from torchyard.store.states import ACTIVE

TABLE_METRICS = ("train/loss", "val/accuracy")  # the metric columns unless asked for others
NAMES_PER_JOB = 100  # a page's metric names (the columns to choose from): this many per job
MAX_PAGE_NAMES = 200
FILTER_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le,
}  # fmt: skip
# Event ids missing from what was read (on PostgreSQL a transaction can commit after one
# that took a later id) are looked for again for this long.
GAP_WAIT_S = 10.0
MAX_GAPS = 1000


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _filters(
    viewer: Viewer, text: str | None, tag: str | None = None, project_id: int | None = None
) -> list[Any]:
    where: list[Any] = [Job.archived_at.is_(None)]  # archived jobs: GET /v1/jobs?archived=
    if project_id is not None:  # ix_jobs_project_created
        where.append(Job.project_id == project_id)
    if tag is not None:  # ix_job_tags_tag
        where.append(Job.id.in_(select(JobTag.job_id).where(JobTag.tag == tag)))
    if not viewer.is_admin:
        where.append(Job.project_id.in_(visible_projects(viewer.user_id)))
    if text:
        pattern = f"%{_escape_like(text)}%"
        match = [
            Job.name.ilike(pattern, escape="\\"),
            Job.id.startswith(text.lower(), autoescape=True),
        ]
        if viewer.is_admin:
            match.append(User.name.ilike(pattern, escape="\\"))
        where.append(or_(*match))
    return where


@dataclass(frozen=True)
class TableView:
    """What the table shows and in which order, beyond its filters: the metric columns (the
    latest value of each name), the order (`sort`: ("created_at" | "metric" | "param",
    name, descending); None: newest first) and metric filters ((name, op of FILTER_OPS,
    number): a job whose latest value of `name` passes each; one without it does not).
    Every name and number is a bound parameter."""

    metrics: Sequence[str] = TABLE_METRICS
    sort: tuple[str, str, bool] | None = None
    filters: Sequence[tuple[str, str, float]] = ()


def _latest(name: str) -> ColumnElement[float]:
    """A job's latest value of metric `name` (its last step): one index probe."""
    return (
        select(Metric.value)
        .where(Metric.job_id == Job.id, Metric.name == name)
        .order_by(Metric.step.desc())
        .limit(1)
        .scalar_subquery()
    )


def _view_filters(view: TableView) -> list[Any]:
    return [FILTER_OPS[op](_latest(name), value) for name, op, value in view.filters]


def _order(view: TableView) -> list[Any]:
    """ORDER BY for the view: its column (nulls last), then newest first (a stable page)."""
    newest = [Job.created_at.desc(), Job.id.desc()]
    if view.sort is None:
        return newest
    kind, name, desc = view.sort
    way: Callable[[Any], Any] = (lambda c: c.desc()) if desc else (lambda c: c.asc())
    if kind == "created_at":
        return [way(Job.created_at), way(Job.id)]
    if kind == "metric":
        value = _latest(name)
        return [value.is_(None), way(value), *newest]
    # A param: numbers first by value, then the others by their JSON text.
    number = json_member_number(Job.spec, "params", name)
    text = json_member_text(Job.spec, "params", name)
    return [text.is_(None), number.is_(None), way(number), way(text), *newest]


def state_counts(
    session: Session,
    viewer: Viewer,
    text: str | None,
    tag: str | None = None,
    view: TableView | None = None,
    project_id: int | None = None,
) -> dict[str, int]:
    """Jobs by state among those the text (and tag) filter keeps (the table's state chips),
    and the view's metric filters."""
    rows = session.execute(
        select(Job.state, func.count())
        .join(User, User.id == Job.owner_id)
        .where(*_filters(viewer, text, tag, project_id), *_view_filters(view or TableView()))
        .group_by(Job.state)
    )
    return {state: int(n) for state, n in rows}


def table_page(
    session: Session,
    viewer: Viewer,
    *,
    states: Sequence[str] = (),
    text: str | None = None,
    tag: str | None = None,
    offset: int = 0,
    limit: int = 100,
    view: TableView | None = None,
    project_id: int | None = None,
) -> list[dict[str, Any]]:
    """A page of the table in the view's order (newest first unless told): each job's
    columns, its spec's `params` (None when it has none), `owner`, `project`, `latest` (the
    newest value of each of the view's metric names, when recorded) and `workers` (the ids
    of the workers of its running attempt, by rank)."""
    view = view or TableView()
    where = [*_filters(viewer, text, tag, project_id), *_view_filters(view)]
    if states:
        where.append(Job.state.in_(list(states)))
    cols = (Job.id, Job.name, Job.state, Job.progress, Job.world_size, Job.attempt,
            Job.created_at, Job.started_at, Job.finished_at, Job.pending_reason,
            Job.sweep_id, Job.tags, Job.spec["params"].label("params"),
            User.name.label("owner"), Project.name.label("project"),
            pruned_trial().label("pruned"))  # fmt: skip
    rows = session.execute(
        select(*cols)
        .join(User, User.id == Job.owner_id)
        .outerjoin(Project, Project.id == Job.project_id)
        .where(*where)
        .order_by(*_order(view))
        .offset(offset)
        .limit(limit)
    ).mappings()
    page = [dict(r) for r in rows]
    ids = [r["id"] for r in page]
    latest = _latest_values(session, ids, view.metrics)
    workers = _running_workers(session, ids)
    for r in page:
        r["latest"] = latest.get(r["id"], {})
        r["workers"] = workers.get(r["id"], [])
    return page


def _latest_values(
    session: Session, ids: list[str], names: Sequence[str]
) -> dict[str, dict[str, float]]:
    """The newest value of each of `names`: one index probe each."""
    if not ids or not names:
        return {}
    probes = [_latest(name) for name in names]
    out: dict[str, dict[str, float]] = {}
    for job_id, *values in session.execute(select(Job.id, *probes).where(Job.id.in_(ids))):
        out[job_id] = {n: v for n, v in zip(names, values, strict=True) if v is not None}
    return out


def page_metric_names(session: Session, ids: Sequence[str]) -> list[str]:
    """The metric names the jobs `ids` have (the metric columns one may choose), sorted: at
    most NAMES_PER_JOB of each job (an index skip each), MAX_PAGE_NAMES in all."""
    names: set[str] = set()
    for job_id in ids:
        names.update(metric_names(session, job_id, limit=NAMES_PER_JOB))
    return sorted(names)[:MAX_PAGE_NAMES]


def _running_workers(session: Session, ids: list[str]) -> dict[str, list[str]]:
    if not ids:
        return {}
    rows = session.execute(
        select(Assignment.job_id, Assignment.worker_id)
        .join(Attempt, Attempt.id == Assignment.attempt_id)
        .where(Assignment.job_id.in_(ids), Attempt.ended_at.is_(None))
        .order_by(Assignment.job_id, Assignment.rank)
    )
    out: dict[str, list[str]] = {}
    for job_id, worker_id in rows:
        out.setdefault(job_id, []).append(worker_id)
    return out


# --- changes -------------------------------------------------------------------------------


def workers_fingerprint(session: Session) -> int:
    """What the workers page shows apart from heartbeat ages (which workers there are, their
    state and job), as one number: a change means the page should reload."""
    rows = session.execute(
        select(Worker.id, Worker.state, Worker.current_job_id).order_by(Worker.id)
    ).all()
    return hash(tuple(tuple(r) for r in rows))


@dataclass
class ChangeState:
    """Where a changes poller is: the last job event read, the event ids still missing
    (id -> when first missed), and the active jobs' (project id, version)."""

    cursor: int = 0
    gaps: dict[int, float] = field(default_factory=dict)
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)


def _active_versions(session: Session) -> dict[str, tuple[int, int]]:
    rows = session.execute(select(Job.id, Job.project_id, Job.version).where(Job.state.in_(ACTIVE)))
    return {job_id: (int(project or 0), int(version)) for job_id, project, version in rows}


def changes_start(session: Session) -> ChangeState:
    """The state of a poller that starts now (what happened before is not a change)."""
    cursor = session.scalar(select(func.max(JobEvent.id))) or 0
    return ChangeState(cursor=int(cursor), versions=_active_versions(session))


def _new_events(session: Session, state: ChangeState, now: float) -> dict[str, int]:
    gaps = list(state.gaps)
    rows = session.execute(
        select(JobEvent.id, JobEvent.job_id, Job.project_id)
        .join(Job, Job.id == JobEvent.job_id)
        .where(or_(JobEvent.id > state.cursor, JobEvent.id.in_(gaps)))
        .order_by(JobEvent.id)
        .limit(MAX_GAPS)
    ).all()
    changed: dict[str, int] = {}
    for event_id, job_id, project in rows:
        changed[job_id] = int(project or 0)
        state.gaps.pop(event_id, None)
        if event_id > state.cursor:
            missed = range(state.cursor + 1, min(event_id, state.cursor + 1 + MAX_GAPS))
            for gap in missed:
                if len(state.gaps) < MAX_GAPS:
                    state.gaps[gap] = now
            state.cursor = event_id
    state.gaps = {k: t for k, t in state.gaps.items() if now - t < GAP_WAIT_S}
    return changed


def changes_since(session: Session, state: ChangeState, now: float) -> dict[str, int]:
    """The jobs (id -> project id, 0 for none) that changed since `state`, which is moved on: those with
    new job events, and the active jobs whose version moved (progress, metrics, attempts),
    started or stopped being active."""
    changed = _new_events(session, state, now)
    versions = _active_versions(session)
    for job_id, (project, version) in versions.items():
        if state.versions.get(job_id, (project, -1))[1] != version:
            changed[job_id] = project
    for job_id in state.versions.keys() - versions.keys():
        changed[job_id] = state.versions[job_id][0]
    state.versions = versions
    return changed


def feed_head(session: Session, job_id: str) -> FeedCursor:
    """A job's event feed position now, for a follower that has just read the job and its
    curves and wants only what comes next (not the whole history again). The metric part
    is the newest id among each curve's last points: one index probe per name."""
    event = session.scalar(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id))
    ckpt = session.scalar(select(func.max(Checkpoint.id)).where(Checkpoint.job_id == job_id))
    metric = 0
    for name in metric_names(session, job_id):
        last = session.scalar(
            select(Metric.id)
            .where(Metric.job_id == job_id, Metric.name == name)
            .order_by(Metric.step.desc())
            .limit(1)
        )
        metric = max(metric, int(last or 0))
    return FeedCursor(int(event or 0), metric, int(ckpt or 0))


def memberships(session: Session, user_ids: set[int]) -> dict[int, set[int]]:
    """The project ids each of `user_ids` has a role in (the dashboard feed filters by them
    on every poll, so a role given or taken is followed within a poll)."""
    found: dict[int, set[int]] = {u: set() for u in user_ids}
    if user_ids:
        q = select(ProjectMember.user_id, ProjectMember.project_id).where(
            ProjectMember.user_id.in_(user_ids)
        )
        for user_id, project_id in session.execute(q):
            found[user_id].add(project_id)
    return found
