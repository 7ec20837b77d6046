"""Webhooks and their durable outbox.

A webhook belongs to a user (their own jobs and sweeps) or to a project (every job and
sweep of it). When a job ends (`store/states.py`: `transition`, `transition_many`) or a
sweep ends (`store/sweeps.py: finish_sweep`), one delivery row per subscribed, active
webhook is written by ONE `INSERT … SELECT`, in the transaction of the state change: the
change and its notifications commit together or not at all, and the body (`payload`) is
frozen then. `scheduler/notify.py` sends them: `claim_due` leases a batch (PostgreSQL:
`FOR UPDATE SKIP LOCKED`; SQLite: its one writer), only the oldest pending delivery of
each (webhook, subject) pair, so one pair's events go out in order; `record_attempt`
keeps every try and decides the next (exponential backoff with jitter, for a day).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    String,
    Text,
    and_,
    cast,
    delete,
    exists,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, aliased

from torchyard.contracts.states import JobState
from torchyard.store.dialect import db_now, db_now_value, in_list, is_postgres
from torchyard.store.models import (
    TRIAL_PRUNED,
    Job,
    Project,
    ProjectMember,
    Sweep,
    SweepTrial,
    User,
    UTCDateTime,
    Webhook,
    WebhookAttempt,
    WebhookDelivery,
    table_of,
    utcnow,
)

JOB_EVENTS = {
    JobState.SUCCEEDED: "job.succeeded",
    JobState.FAILED: "job.failed",
    JobState.CANCELLED: "job.cancelled",
}
SWEEP_COMPLETED = "sweep.completed"
EVENTS = (*JOB_EVENTS.values(), SWEEP_COMPLETED)

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
# Retry delays as multiples of TORCHYARD_WEBHOOK_RETRY_BASE_S (10 s: 10 s, 30 s, 1 min,
# 2 min, 5 min, 10 min, 20 min, 40 min, then hourly), each ±20%; a delivery not sent a day
# after its event is failed.
BACKOFF = (1, 3, 6, 12, 30, 60, 120, 240, 360)
JITTER = 0.2
GIVE_UP_AFTER = timedelta(days=1)
MAX_ERROR = 500


# --- the outbox, written with the state change -----------------------------------------------


def _json_object(session: Session, pairs: Sequence[tuple[str, Any]]) -> Any:
    """A JSON object built by the database (json_build_object / json_object); keys are our
    own constants, values SQL expressions."""
    fn = func.json_build_object if is_postgres(session) else func.json_object
    args: list[Any] = []
    for key, value in pairs:
        args += [literal_column(f"'{key}'"), value]
    return fn(*args)


def _text(value: str | None) -> Any:
    # Typed, so PostgreSQL knows a parameter's type inside json_build_object's "any".
    return cast(literal(value), String())


def _subscribed(session: Session, event: str) -> ColumnElement[bool]:
    """The webhook is active and lists `event`."""
    if is_postgres(session):
        listed = cast(Webhook.events, JSONB).contains(cast(_text(json.dumps([event])), JSONB))
    else:
        each = func.json_each(Webhook.events).table_valued("value")
        listed = exists().where(each.c.value == event)
    return and_(Webhook.active.is_(True), listed)


def _delivery_id(session: Session) -> Any:
    """A fresh uuid4 hex per row, made by the database."""
    if is_postgres(session):
        return func.replace(cast(func.gen_random_uuid(), String()), "-", "")
    return func.lower(func.hex(func.randomblob(16)))


def _now(session: Session) -> Any:
    """The database's clock on PostgreSQL (the sender compares with it), ours on SQLite."""
    value = db_now_value(session)
    return value if is_postgres(session) else literal(value, UTCDateTime)


def _insert(session: Session, rows: Any) -> None:
    cols = ["id", "webhook_id", "event", "subject", "payload", "created_at", "state",
            "attempts", "next_attempt_at"]  # fmt: skip
    session.execute(insert(table_of(WebhookDelivery)).from_select(cols, rows))


def enqueue_job_events(
    session: Session, job_ids: Sequence[str], to_state: str, finished_at: datetime
) -> None:
    """The deliveries of jobs that just moved to `to_state` (a terminal state), in the
    caller's transaction, after the jobs' UPDATE: one statement whatever the number of
    jobs and webhooks."""
    event = JOB_EVENTS.get(JobState(to_state))
    if event is None or not job_ids:
        return
    owner, project = aliased(User), aliased(Project)
    body = _json_object(session, [
        ("event", _text(event)),
        ("job", _json_object(session, [
            ("id", Job.id), ("name", Job.name), ("state", _text(to_state)),
            ("project", project.name), ("owner", owner.name), ("error", Job.error),
            ("attempt", cast(Job.attempt, Integer())), ("sweep_id", Job.sweep_id),
            ("finished_at", _text(finished_at.isoformat())),
        ])),
    ])  # fmt: skip
    now = _now(session)
    rows = (
        select(
            _delivery_id(session),
            Webhook.id,
            literal(event),
            Job.id,
            body,
            now,
            literal(PENDING),
            literal(0),
            now,
        )
        .select_from(Job)
        .join(owner, owner.id == Job.owner_id)
        .outerjoin(project, project.id == Job.project_id)
        .join(Webhook, _owns(Job.owner_id, Job.project_id))
        .where(in_list(session, Job.id, list(job_ids)), _subscribed(session, event))
    )
    if event == JOB_EVENTS[JobState.CANCELLED]:  # a pruned trial: sweep.completed covers it
        rows = rows.where(~exists().where(
            SweepTrial.job_id == Job.id, SweepTrial.outcome == TRIAL_PRUNED
        ))  # fmt: skip
    _insert(session, rows)


def _owns(owner_id: Any, project_id: Any) -> ColumnElement[bool]:
    """The webhook is the subject's project's, or its owner's own (no project)."""
    return or_(
        Webhook.project_id == project_id,
        and_(Webhook.project_id.is_(None), Webhook.owner_id == owner_id),
    )


def enqueue_sweep_event(session: Session, sweep: Sweep) -> None:
    """`sweep.completed` for a sweep that just ended (succeeded, failed or cancelled: its
    state is in the body), in the caller's transaction."""
    owner = select(User.name).where(User.id == sweep.owner_id).scalar_subquery()
    project = select(Project.name).where(Project.id == sweep.project_id).scalar_subquery()
    finished = (sweep.finished_at or utcnow()).isoformat()
    body = _json_object(session, [
        ("event", _text(SWEEP_COMPLETED)),
        ("sweep", _json_object(session, [
            ("id", _text(sweep.id)), ("name", _text(sweep.name)), ("state", _text(sweep.state)),
            ("project", project), ("owner", owner), ("error", _text(sweep.error)),
            ("finished_at", _text(finished)),
        ])),
    ])  # fmt: skip
    now = _now(session)
    rows = select(
        _delivery_id(session), Webhook.id, literal(SWEEP_COMPLETED), literal(sweep.id), body,
        now, literal(PENDING), literal(0), now,
    ).where(_owns(sweep.owner_id, sweep.project_id), _subscribed(session, SWEEP_COMPLETED))  # fmt: skip
    _insert(session, rows)


# --- webhooks: create, see, delete --------------------------------------------------------------


def create_webhook(
    session: Session,
    owner_id: int,
    project_id: int | None,
    url: str,
    events: Sequence[str],
    secret: str,
) -> Webhook:
    hook = Webhook(owner_id=owner_id, project_id=project_id, url=url, events=list(events),
                   secret=secret, active=True, created_at=utcnow())  # fmt: skip
    session.add(hook)
    session.flush()
    return hook


def visible_to(user_id: int, is_admin: bool) -> ColumnElement[bool]:
    """The webhooks a user manages: their own (no project) and those of the projects they
    own; admins every one."""
    if is_admin:
        return literal(True)
    owned = select(ProjectMember.project_id).where(
        ProjectMember.user_id == user_id, ProjectMember.role == "owner"
    )
    return or_(
        and_(Webhook.project_id.is_(None), Webhook.owner_id == user_id),
        Webhook.project_id.in_(owned),
    )


@dataclass(frozen=True)
class WebhookView:
    hook: Webhook
    owner: str
    project: str | None


def list_webhooks(
    session: Session, user_id: int, is_admin: bool, webhook_id: str | None = None
) -> list[WebhookView]:
    """The webhooks the user manages (oldest first), or the one `webhook_id` if so."""
    q = (
        select(Webhook, User.name, Project.name)
        .join(User, User.id == Webhook.owner_id)
        .outerjoin(Project, Project.id == Webhook.project_id)
        .where(visible_to(user_id, is_admin))
        .order_by(Webhook.created_at, Webhook.id)
    )
    if webhook_id is not None:
        q = q.where(Webhook.id == webhook_id)
    return [WebhookView(h, o, p) for h, o, p in session.execute(q)]


def delete_webhook(session: Session, webhook_id: str) -> None:
    """The webhook, its deliveries (sent or not) and their attempts."""
    ids = select(WebhookDelivery.id).where(WebhookDelivery.webhook_id == webhook_id)
    session.execute(delete(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(ids)))
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id))
    session.execute(delete(Webhook).where(Webhook.id == webhook_id))


def deliveries_of(
    session: Session, webhook_id: str, limit: int, before_seq: int | None = None
) -> list[tuple[WebhookDelivery, list[WebhookAttempt]]]:
    """A webhook's deliveries, newest first (those before `before_seq`), each with its
    attempts in order."""
    q = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
    if before_seq is not None:
        q = q.where(WebhookDelivery.seq < before_seq)
    rows = list(session.scalars(q.order_by(WebhookDelivery.seq.desc()).limit(limit)))
    tries: dict[str, list[WebhookAttempt]] = {d.id: [] for d in rows}
    if rows:
        found = session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(tries)))
            .order_by(WebhookAttempt.id)
        )
        for a in found:
            tries[a.delivery_id].append(a)
    return [(d, tries[d.id]) for d in rows]


# --- the sender's reads and writes -----------------------------------------------------------


@dataclass(frozen=True)
class Due:
    """A delivery claimed for sending, with what sending it needs."""

    id: str
    event: str
    payload: dict[str, Any]
    url: str
    secret: str
    attempts: int
    created_at: datetime


def claim_due(session: Session, claimer: str, lease_s: float, limit: int) -> list[Due]:
    """Lease up to `limit` due deliveries to `claimer` for `lease_s` seconds and return
    them; the caller commits. Due: pending, its time come, no live lease, and no older
    delivery of its (webhook, subject) still pending (the order per pair). A sender that
    dies leaves its lease to expire; the next claim takes the delivery again."""
    now = db_now(session)
    older = aliased(WebhookDelivery)
    d = WebhookDelivery
    q = (
        select(d.seq)
        .where(
            d.state == PENDING,
            d.next_attempt_at <= now,
            or_(d.lease_until.is_(None), d.lease_until < now),
            ~exists().where(
                older.webhook_id == d.webhook_id,
                older.subject == d.subject,
                older.state == PENDING,
                older.seq < d.seq,
            ),
        )
        .order_by(d.seq)
        .limit(limit)
    )
    if is_postgres(session):
        q = q.with_for_update(of=d, skip_locked=True)
    seqs = list(session.scalars(q))
    if not seqs:
        return []
    # SQLite: this UPDATE runs under the one write lock the claim's BEGIN IMMEDIATE took,
    # so two senders cannot both see a delivery free; the condition repeats it anyway.
    session.execute(
        update(d)
        .where(in_list(session, d.seq, seqs), or_(d.lease_until.is_(None), d.lease_until < now))
        .values(lease_until=now + timedelta(seconds=lease_s), claimed_by=claimer)
        .execution_options(synchronize_session=False)
    )
    rows = session.execute(
        select(d.id, d.event, d.payload, Webhook.url, Webhook.secret, d.attempts, d.created_at)
        .join(Webhook, Webhook.id == d.webhook_id)
        .where(in_list(session, d.seq, seqs), d.claimed_by == claimer)
        .order_by(d.seq)
    )
    return [Due(*r) for r in rows]


def retry_delay(attempts: int, base_s: float, rng: random.Random | None = None) -> float:
    """Seconds before the next try after `attempts` failed ones (1 or more), jittered."""
    step = BACKOFF[min(attempts, len(BACKOFF)) - 1] * base_s
    return step * (1 + JITTER * (2 * (rng or random).random() - 1))


@dataclass(frozen=True)
class Outcome:
    """One try's result: the receiver's status (None: no answer) and why it failed."""

    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def record_attempt(
    session: Session, due: Due, claimer: str, outcome: Outcome, base_s: float
) -> str:
    """Keep the try and move the delivery on: delivered, or pending again after the
    backoff, or failed once that would pass a day after its event. Returns its state.
    A failure is recorded only while the claim is still ours (a late sender must not push
    back a retry someone else now holds); a success always ends a pending delivery."""
    error = outcome.error and outcome.error[:MAX_ERROR]
    # Through a SELECT of the delivery: one deleted meanwhile (its webhook was) gets none.
    kept = select(WebhookDelivery.id, literal(outcome.started_at, UTCDateTime),
                  literal(outcome.duration_ms, Integer()), literal(outcome.status_code, Integer()),
                  literal(error, Text())).where(WebhookDelivery.id == due.id)  # fmt: skip
    cols = ["delivery_id", "started_at", "duration_ms", "status_code", "error"]
    session.execute(insert(table_of(WebhookAttempt)).from_select(cols, kept))
    n = due.attempts + 1
    values: dict[str, Any] = {"attempts": WebhookDelivery.attempts + 1,
                              "last_status_code": outcome.status_code,
                              "last_error": error,
                              "lease_until": None, "claimed_by": None}  # fmt: skip
    cond = [WebhookDelivery.id == due.id, WebhookDelivery.state == PENDING]
    if outcome.ok:
        state = DELIVERED
        values.update(state=DELIVERED, delivered_at=utcnow())
    else:
        cond.append(WebhookDelivery.claimed_by == claimer)
        at = utcnow() + timedelta(seconds=retry_delay(n, base_s))
        state = FAILED if at > due.created_at + GIVE_UP_AFTER else PENDING
        values.update(state=state, next_attempt_at=at)
    session.execute(
        update(WebhookDelivery)
        .where(*cond)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return state


def pending_count(session: Session) -> int:
    """Deliveries not yet sent nor given up (for tests and the bench)."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(WebhookDelivery)
            .where(WebhookDelivery.state == PENDING)
        )
        or 0
    )


def remove_ended_deliveries(session: Session, older_than_s: float, limit: int = 10_000) -> int:
    """Deliveries sent or given up whose event is more than `older_than_s` old (on the
    database's clock), with their tries; at most `limit` a call, oldest first, so one
    transaction stays short however far behind it is. Pending ones always stay (they
    are the outbox). Returns how many were removed."""
    cutoff = db_now(session) - timedelta(seconds=older_than_s)
    ids = (
        select(WebhookDelivery.id)
        .where(WebhookDelivery.state != PENDING, WebhookDelivery.created_at < cutoff)
        .order_by(WebhookDelivery.seq)
        .limit(limit)
    )
    chosen = list(session.scalars(ids))
    if not chosen:
        return 0
    # Explicitly, not by the foreign key's cascade: SQLite connections made without the
    # foreign_keys pragma (a tool's, a restore's) would leave the tries behind.
    session.execute(
        delete(WebhookAttempt).where(in_list(session, WebhookAttempt.delivery_id, chosen))
    )
    session.execute(delete(WebhookDelivery).where(in_list(session, WebhookDelivery.id, chosen)))
    return len(chosen)
