"""What a job's event stream (SSE) sends: state changes (job_events), new metric points
and new checkpoints, read by polling the store, which works the same on both databases.

A feed position is one cursor over the three sources, `"<event id>-<metric id>-<checkpoint
id>"`: every item carries the cursor just past it, so a client that reconnects with
`Last-Event-ID` gets exactly what it has not seen. Metric and checkpoint rows are re-used
when re-announced (idempotent writes), so a replay after resume is not sent twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from torchyard.store.models import Checkpoint, Job, JobEvent, Metric
from torchyard.store.states import TERMINAL

_CURSOR = re.compile(r"^(\d{1,19})-(\d{1,19})-(\d{1,19})$")


class BadFeedCursor(ValueError):
    """A Last-Event-ID this server did not hand out."""


@dataclass(frozen=True)
class FeedCursor:
    event: int = 0
    metric: int = 0
    checkpoint: int = 0

    def encode(self) -> str:
        return f"{self.event}-{self.metric}-{self.checkpoint}"

    @classmethod
    def parse(cls, value: str | None) -> FeedCursor:
        if not value:
            return cls()
        m = _CURSOR.match(value.strip())
        if m is None:
            raise BadFeedCursor(f"not an event id of this stream: {value!r}")
        return cls(int(m[1]), int(m[2]), int(m[3]))


@dataclass(frozen=True)
class FeedItem:
    type: str  # "state", "metric" or "checkpoint"
    data: dict[str, Any]
    cursor: FeedCursor


@dataclass(frozen=True)
class FeedPage:
    state: str | None  # the job's state read before the sources (None: job gone)
    items: list[FeedItem]
    cursor: FeedCursor
    more: bool  # a source had more rows than the page could hold
    pending_reason: str | None = None  # why a queued job waits (read with the state)

    @property
    def finished(self) -> bool:
        """The job ended before this page was read and the page was empty: nothing
        written before the end remains unsent."""
        return self.state is None or (self.state in TERMINAL and not self.items)


def _metrics(session: Session, job_id: str, after: int, limit: int) -> list[Any]:
    return list(
        session.execute(
            select(Metric.id, Metric.name, Metric.step, Metric.epoch, Metric.value, Metric.time)
            .where(Metric.job_id == job_id, Metric.id > after)
            .order_by(Metric.id)
            .limit(limit)
        ).all()
    )


def _checkpoint_data(c: Checkpoint) -> dict[str, Any]:
    return {
        "id": c.id,
        "step": int(c.step),
        "epoch": c.epoch,
        "kind": c.kind,
        "bytes": int(c.bytes),
        "sha256": c.sha256,
        "attempt": c.attempt,
        "created_at": c.created_at.isoformat(),
    }


def _state_data(ev: JobEvent) -> dict[str, Any]:
    return {
        "state": ev.data.get("to"),
        "from": ev.data.get("from"),
        "reason": ev.data.get("reason"),
        "attempt": ev.data.get("attempt"),
        "time": ev.created_at.isoformat(),
    }


def poll(session: Session, job_id: str, cursor: FeedCursor, limit: int = 500) -> FeedPage:
    """The next items after `cursor`: metrics, then checkpoints, then state changes
    (so the final state comes after the last points it follows)."""
    # Read the state first: if it is terminal, everything the worker wrote before it
    # is already committed and will be seen by the queries below.
    head = session.execute(select(Job.state, Job.pending_reason).where(Job.id == job_id)).first()
    state, pending = (head[0], head[1]) if head is not None else (None, None)
    items: list[FeedItem] = []
    cur = cursor

    metrics = _metrics(session, job_id, cursor.metric, limit)
    for mid, name, step, epoch, value, time in metrics:
        cur = replace(cur, metric=mid)
        data = {"name": name, "step": int(step), "epoch": epoch, "value": value, "time": time}
        items.append(FeedItem("metric", data, cur))

    checkpoints = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.id > cursor.checkpoint)
        .order_by(Checkpoint.id)
        .limit(limit)
    ).all()
    for c in checkpoints:
        cur = replace(cur, checkpoint=c.id)
        items.append(FeedItem("checkpoint", _checkpoint_data(c), cur))

    events = session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.id > cursor.event)
        .order_by(JobEvent.id)
        .limit(limit)
    ).all()
    for ev in events:
        cur = replace(cur, event=ev.id)
        if ev.type == "state":  # other job events (worker notes) are not part of the stream
            items.append(FeedItem("state", _state_data(ev), cur))
    # Skipped non-state events advance `cursor` but no item: a resumed stream reads
    # and skips them again, which is harmless.
    more = limit in (len(metrics), len(checkpoints), len(events))
    return FeedPage(state=state, items=items, cursor=cur, more=more, pending_reason=pending)
