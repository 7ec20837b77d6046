"""One scheduling pass: read the idle workers and the head of the queue, plan with
`scheduler/policy.py`, write the result in one batch (`store/queue.py`), and return the
messages to send once the caller has committed.

Only as many queued jobs are read as could be placed on the idle workers (every job takes
at least one), plus `LOOKAHEAD` more so that small jobs behind big waiting ones still
backfill and the jobs at the head of a full cluster's queue get their pending reason.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy.orm import Session

from torchyard.scheduler.policy import RESERVE_AFTER_S, Kind, kind_of, plan
from torchyard.store.dialect import db_now
from torchyard.store.models import utcnow
from torchyard.store.queue import (
    idle_workers,
    live_counts,
    queue_head,
    set_pending_reasons,
    start_gangs,
)
from torchyard.store.workers import stale_cutoff

LOOKAHEAD = 200


class Dispatch(NamedTuple):
    """One message to send after the pass commits: RUN_TASK(assignment_id) to `queue`."""

    job_id: str
    assignment_id: int
    worker_id: str
    queue: str
    rank: int


def schedule(
    session: Session,
    *,
    heartbeat_timeout_s: float,
    reserve_after_s: float = RESERVE_AFTER_S,
    now: datetime | None = None,
) -> list[Dispatch]:
    """Run one pass in the caller's transaction; the caller commits, then sends the
    returned dispatches (never before: a worker must find its assignment in the store).
    A pass that lost a race (a row changed under it) writes nothing and returns []: the
    next pass sees the new state."""
    now = now or db_now(session)
    cutoff = stale_cutoff(session, heartbeat_timeout_s, now)
    free = idle_workers(session, cutoff)
    jobs = queue_head(session, len(free) + LOOKAHEAD)
    if not jobs:
        return []
    live_kinds: dict[Kind, int] = {}
    for device, name, count in live_counts(session, cutoff):
        k = kind_of(device, name)
        live_kinds[k] = live_kinds.get(k, 0) + count
    p = plan(jobs, free, live_kinds, now=now, reserve_after_s=reserve_after_s)
    started = start_gangs(session, p.gangs)
    set_pending_reasons(session, p.reasons)
    return [Dispatch(*s) for s in started or []]


def resend_due(last_sent: dict[int, datetime], assignment_id: int, every_s: float) -> bool:
    """Whether the reconciler should re-send an unclaimed assignment now (at most every
    `every_s` seconds each), updating `last_sent`."""
    t = utcnow()
    prev = last_sent.get(assignment_id)
    if prev is not None and t - prev < timedelta(seconds=every_s):
        return False
    last_sent[assignment_id] = t
    return True
