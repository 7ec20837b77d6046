"""The webhook routes' bodies (api/routers/webhooks.py) and their checks: a webhook asked
for (`url`, `events`, `secret`, `project`), as listed (the secret masked), as created (the
secret once), and its deliveries with every attempt."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from torchyard.scheduler.notify import url_problem
from torchyard.scheduler.webhook_guard import Rule
from torchyard.store.webhooks import EVENTS

MAX_URL = 2000
# A secret is what a receiver types into its own configuration: printable ASCII.
_SECRET = re.compile(r"^[\x21-\x7e]+$")


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL, description="where to POST: an http(s) URL")
    events: list[str] = Field(
        min_length=1,
        max_length=20,
        description=f"what to send: any of {', '.join(EVENTS)}",
    )
    secret: str | None = Field(
        default=None,
        min_length=16,
        max_length=256,
        description="the HMAC-SHA256 key of X-Torchyard-Signature (16 to 256 printable "
        "characters); made for you when absent, and shown in this answer only",
    )
    project: str | None = Field(
        default=None,
        min_length=1,
        max_length=101,
        description="the project whose jobs and sweeps to report (its owners only); "
        "absent: your own jobs and sweeps",
    )


def problems(body: WebhookIn, rule: Rule) -> list[tuple[str, str]]:
    """Every problem of the body, each naming its field (the API answers 422)."""
    out: list[tuple[str, str]] = []
    bad_url = url_problem(body.url, rule)
    if bad_url is not None:
        out.append(("url", bad_url))
    unknown = [e for e in body.events if e not in EVENTS]
    if unknown:
        out.append(("events", f"unknown event {unknown[0]!r} (known: {', '.join(EVENTS)})"))
    if body.secret is not None and not _SECRET.match(body.secret):
        out.append(("secret", "must be printable ASCII without spaces"))
    return out


def masked(secret: str) -> str:
    """What a listed webhook shows of its secret: its last four characters."""
    return "…" + secret[-4:]


class WebhookOut(BaseModel):
    id: str
    url: str
    events: list[str]
    project: str | None = Field(description="its project; null: its owner's own jobs")
    owner: str = Field(description="who made it")
    active: bool
    secret: str = Field(description="masked: its last characters only")
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="the signing secret: shown in this answer only")


class WebhookList(BaseModel):
    items: list[WebhookOut] = Field(description="oldest first")
    next_cursor: str | None = None


class DeliveryAttemptOut(BaseModel):
    started_at: datetime
    duration_ms: int
    status_code: int | None = Field(description="the receiver's answer; null: none")
    error: str | None = Field(description="why the try failed; null: it succeeded")


class DeliveryOut(BaseModel):
    id: str = Field(description="X-Torchyard-Delivery: the same on every retry")
    event: str
    subject: str = Field(description="the job's or the sweep's id")
    state: Literal["pending", "delivered", "failed"]
    created_at: datetime
    next_attempt_at: datetime | None = Field(description="null once delivered or failed")
    delivered_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    payload: dict[str, Any] = Field(description="the body sent")
    attempts: list[DeliveryAttemptOut] = Field(description="every try, oldest first")


class DeliveryList(BaseModel):
    items: list[DeliveryOut] = Field(description="newest first")
    next_cursor: str | None = Field(default=None, description="`cursor` of the next page")
