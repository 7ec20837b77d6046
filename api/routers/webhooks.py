"""Webhooks: create, list, delete, and each one's deliveries with their attempts.

A webhook reports its owner's own jobs and sweeps, or, with `project`, every job and sweep
of a project: only that project's owners (and admins) may make one, and they (not its
maker, once no longer an owner) manage it. A webhook the caller does not manage is a 404,
as a missing one is. The secret is answered once, at create; lists show its last
characters only. Sending is scheduler/notify.py's; the rows are store/webhooks.py's."""

from __future__ import annotations

import secrets
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Path, Query, Request, Response
from sqlalchemy.orm import Session

from torchyard.api.deps import (
    CurrentUser,
    Principal,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    actor_of,
)
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.roles import require_role
from torchyard.api.webhook_schemas import (
    DeliveryAttemptOut,
    DeliveryList,
    DeliveryOut,
    WebhookCreated,
    WebhookIn,
    WebhookList,
    WebhookOut,
    masked,
    problems,
)
from torchyard.scheduler.webhook_guard import rule_for
from torchyard.store import projects as proj
from torchyard.store import webhooks as hooks
from torchyard.store.audit import record
from torchyard.store.models import WebhookAttempt, WebhookDelivery

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

WebhookId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="the webhook's id")]
NO_STORE = {"Cache-Control": "no-store"}


def _out(view: hooks.WebhookView) -> WebhookOut:
    h = view.hook
    return WebhookOut(id=h.id, url=h.url, events=list(h.events), project=view.project,
                      owner=view.owner, active=h.active, secret=masked(h.secret),
                      created_at=h.created_at)  # fmt: skip


def _project_id(session: Session, user: Principal, name: str | None) -> int | None:
    """The project a new webhook reports on: 404 when the caller has no role in it, 403
    below owner."""
    if name is None:
        return None
    project = proj.project_named(session, name)
    if project is None or (
        not user.is_admin and proj.role_of(session, user.id, project.id) is None
    ):
        raise not_found("project")
    require_role(session, user, project.id, "owner", "add a webhook")
    return project.id


def _origin(url: str) -> str:
    """What the audit trail keeps of a URL: scheme, host and port (a path or a query may
    hold the receiver's own secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


@router.post(
    "",
    status_code=201,
    response_model=WebhookCreated,
    summary="Create a webhook",
    description="POSTs each listed event (job.succeeded, job.failed, job.cancelled, "
    "sweep.completed) to `url`, signed with `secret` (made for you when absent; answered "
    "here only). With `project`: that project's jobs and sweeps (its owners only).",
    responses=responses(401, 403, 404, 422, 503),
)
def create_webhook_route(
    body: WebhookIn,
    request: Request,
    response: Response,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
) -> WebhookCreated:
    found = problems(body, rule_for(settings))
    if found:
        raise validation_error(found, "webhook")
    project_id = _project_id(session, user, body.project)
    secret = body.secret or secrets.token_urlsafe(32)
    events = list(dict.fromkeys(body.events))
    hook = hooks.create_webhook(session, user.id, project_id, body.url, events, secret)
    details = {"url": _origin(body.url), "events": events, "project": body.project}
    record(session, actor_of(request, user), "webhook.create", f"webhook:{hook.id}", details,
           project_id=project_id)  # fmt: skip
    session.commit()
    response.headers.update(NO_STORE)
    out = _out(hooks.WebhookView(hook, user.name, body.project))
    return WebhookCreated(**(out.model_dump() | {"secret": secret}))


@router.get(
    "",
    response_model=WebhookList,
    summary="List webhooks",
    description="Your own webhooks and those of the projects you own (admins: every "
    "one), oldest first; each secret masked.",
    responses=responses(401, 503),
)
def list_webhooks_route(user: CurrentUser, session: ReadSessionDep) -> WebhookList:
    views = hooks.list_webhooks(session, user.id, user.is_admin)
    return WebhookList(items=[_out(v) for v in views])


def _managed(session: Session, user: Principal, webhook_id: str) -> hooks.WebhookView:
    found = hooks.list_webhooks(session, user.id, user.is_admin, webhook_id)
    if not found:
        raise not_found("webhook")
    return found[0]


@router.delete(
    "/{webhook_id}",
    status_code=204,
    summary="Delete a webhook",
    description="The webhook, its deliveries (pending ones are not sent) and their "
    "attempts. One you do not manage is 404.",
    responses=responses(401, 404, 422, 503),
)
def delete_webhook_route(
    webhook_id: WebhookId, request: Request, user: CurrentUser, session: SessionDep
) -> Response:
    view = _managed(session, user, webhook_id)
    hooks.delete_webhook(session, webhook_id)
    details = {"url": _origin(view.hook.url), "project": view.project}
    record(session, actor_of(request, user), "webhook.delete", f"webhook:{webhook_id}",
           details, project_id=view.hook.project_id)  # fmt: skip
    session.commit()
    return Response(status_code=204)


def _delivery(d: WebhookDelivery, tries: list[WebhookAttempt]) -> DeliveryOut:
    return DeliveryOut(
        id=d.id, event=d.event, subject=d.subject, state=d.state,  # type: ignore[arg-type]
        created_at=d.created_at,
        next_attempt_at=d.next_attempt_at if d.state == hooks.PENDING else None,
        delivered_at=d.delivered_at, last_status_code=d.last_status_code,
        last_error=d.last_error, payload=d.payload,
        attempts=[DeliveryAttemptOut(started_at=a.started_at, duration_ms=a.duration_ms,
                             status_code=a.status_code, error=a.error) for a in tries],
    )  # fmt: skip


@router.get(
    "/{webhook_id}/deliveries",
    response_model=DeliveryList,
    summary="A webhook's deliveries",
    description="Newest first, each with its state and every attempt (when, how long, the "
    "receiver's status or the error). `cursor`: the previous page's `next_cursor`.",
    responses=responses(401, 404, 422, 503),
)
def deliveries_route(
    webhook_id: WebhookId,
    user: CurrentUser,
    session: ReadSessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,18}$")] = None,
) -> DeliveryList:
    _managed(session, user, webhook_id)
    before = int(cursor) if cursor is not None else None
    rows = hooks.deliveries_of(session, webhook_id, limit, before)
    more = len(rows) == limit and rows[-1][0].seq > 1
    return DeliveryList(
        items=[_delivery(d, t) for d, t in rows],
        next_cursor=str(rows[-1][0].seq) if more else None,
    )
