"""One scheduling pass: queued jobs, by priority then age, to idle live workers, all ranks
of a job at once (gang) or none; jobs that wait get a `pending_reason`.

A gang is of one kind: all CPU workers, or all GPUs of one model (as nvidia-smi names it;
GPUs of unknown name go together). A CPU rank would pick gloo where the GPU ranks pick
NCCL and the rendezvous would hang, and a mixed-model gang runs at its slowest card's pace
and can resolve `precision: auto` differently.

Backfill policy. Jobs are considered in order (priority desc, created_at asc). A job
that does not fit in the idle workers now does not stop smaller jobs behind it from
starting on the idle workers that are left (backfill), so a big job never blocks the
queue. To keep a big job from starving behind a stream of small ones, a job that has
waited longer than `reserve_after_s` reserves the idle workers it needs: from then on
workers that become idle accumulate for it and jobs behind it get only what is left
over. A job that asks for more workers than are registered and live cannot be helped by
waiting, so it never reserves (its reason says how many are registered).

Safety with several schedulers: on PostgreSQL idle workers and queued jobs are selected
FOR UPDATE SKIP LOCKED, so two passes never see the same rows; on SQLite the pass's
transaction is BEGIN IMMEDIATE (store/db.py), which serialises writers. Either way each
worker is taken with a conditional update (state idle -> busy, rowcount checked) and the
job with the conditional state transition, so a lost race is skipped, never doubled.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from torchyard.store.attempts import assignments_of, create_attempt
from torchyard.store.dialect import db_now, is_postgres
from torchyard.store.models import Job, Worker, utcnow
from torchyard.store.states import QUEUED, STARTING, IllegalTransition, transition
from torchyard.store.workers import BUSY, IDLE, LIVE, stale_cutoff

RESERVE_AFTER_S = 300.0
SCAN_LIMIT = 1000


@dataclass(frozen=True)
class Dispatch:
    """One message to send after the pass commits: RUN_TASK(assignment_id) to `queue`."""

    job_id: str
    assignment_id: int
    worker_id: str
    queue: str
    rank: int


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


Kind = tuple[str, str]


def gang_kind(w: Worker) -> Kind:
    """Workers of one kind may share a job: ("cpu", "") or ("cuda", GPU model)."""
    return (w.device, w.device_name or "") if w.device == "cuda" else ("cpu", "")


def describe_kind(k: Kind) -> str:
    return "cpu" if k[0] == "cpu" else (k[1] or "gpu")


def _by_kind(workers: list[Worker]) -> dict[Kind, list[Worker]]:
    out: dict[Kind, list[Worker]] = defaultdict(list)
    for w in workers:
        out[gang_kind(w)].append(w)
    return out


def _pick_gang(free: list[Worker], n: int) -> list[Worker] | None:
    """n idle workers of one kind (the kind with the fewest idle that still fits, keeping
    big pools whole for big jobs), or None if no kind has n idle."""
    fitting = [ws for ws in _by_kind(free).values() if len(ws) >= n]
    if not fitting:
        return None
    return _pick(min(fitting, key=len), n)


def _pick(free: list[Worker], n: int) -> list[Worker]:
    """n workers from `free`: all on one host when a host has enough (the one with the
    fewest idle that still fits, keeping big hosts whole for big jobs), else from the
    hosts with most idle workers first (fewest hosts spanned)."""
    by_host: dict[str, list[Worker]] = defaultdict(list)
    for w in free:
        by_host[w.host].append(w)
    fitting = [ws for ws in by_host.values() if len(ws) >= n]
    if fitting:
        return min(fitting, key=len)[:n]
    chosen: list[Worker] = []
    for ws in sorted(by_host.values(), key=len, reverse=True):
        chosen += ws[: n - len(chosen)]
        if len(chosen) == n:
            break
    return chosen


def _claim_workers(session: Session, job: Job, workers: list[Worker]) -> bool:
    for w in workers:
        res = session.execute(
            update(Worker)
            .where(Worker.id == w.id, Worker.state == IDLE)
            .values(state=BUSY, current_job_id=job.id)
            .execution_options(synchronize_session=False)
        )
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
    return True


def _assign(session: Session, job: Job, workers: list[Worker]) -> list[Dispatch] | None:
    """Gang-assign `workers` to `job` inside a savepoint; None if a race was lost."""
    sp = session.begin_nested()
    try:
        if not _claim_workers(session, job, workers):
            sp.rollback()
            return None
        attempt = create_attempt(session, job, workers)
        out = []
        for a, w in zip(assignments_of(session, attempt.id), workers, strict=True):
            session.execute(
                update(Worker)
                .where(Worker.id == w.id)
                .values(current_assignment_id=a.id)
                .execution_options(synchronize_session=False)
            )
            out.append(Dispatch(job.id, a.id, w.id, w.queue, a.rank))
        transition(session, job, STARTING, reason=f"assigned to {', '.join(w.id for w in workers)}")
        sp.commit()
        return out
    except IllegalTransition:
        sp.rollback()
        return None


def schedule(
    session: Session,
    *,
    heartbeat_timeout_s: float,
    reserve_after_s: float = RESERVE_AFTER_S,
    now: datetime | None = None,
) -> list[Dispatch]:
    """Run one pass in the caller's transaction; the caller commits, then sends the
    returned dispatches (never before: a worker must find its assignment in the store)."""
    now = now or db_now(session)
    cutoff = stale_cutoff(session, heartbeat_timeout_s, now)
    pg = is_postgres(session)

    wq = (
        select(Worker)
        .where(Worker.state == IDLE, Worker.last_heartbeat >= cutoff)
        .order_by(Worker.host, Worker.id)
    )
    jq = (
        select(Job)
        .where(Job.state == QUEUED)
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(SCAN_LIMIT)
    )
    if pg:
        wq = wq.with_for_update(skip_locked=True)
        jq = jq.with_for_update(skip_locked=True)
    free = list(session.scalars(wq))
    jobs = list(session.scalars(jq))
    if not jobs:
        return []
    live_rows = session.execute(
        select(Worker.device, Worker.device_name, func.count())
        .where(Worker.state.in_(LIVE), Worker.last_heartbeat >= cutoff)
        .group_by(Worker.device, Worker.device_name)
    ).all()
    live_kinds: dict[Kind, int] = defaultdict(int)
    for device, name, count in live_rows:
        live_kinds[("cuda", name or "") if device == "cuda" else ("cpu", "")] += int(count)
    live = sum(live_kinds.values())
    biggest = max(live_kinds.values(), default=0)
    dispatches: list[Dispatch] = []
    waiting_ahead = 0  # jobs earlier in the order that wait and could run on this cluster
    for job in jobs:
        n = job.world_size
        reason: str | None = None
        chosen = _pick_gang(free, n) if n <= biggest else None
        if live == 0:
            reason = "no worker registered"
        elif n > live:
            reason = f"needs {_plural(n, 'worker')}, {live} registered"
        elif n > biggest:
            kinds = ", ".join(
                f"{c} {describe_kind(k)}" for k, c in sorted(live_kinds.items(), key=str)
            )
            reason = (
                f"needs {_plural(n, 'worker')} of one kind (a job never mixes CPU and GPU "
                f"workers or GPU models); registered: {kinds}"
            )
        elif chosen is not None:
            out = _assign(session, job, chosen)
            if out is not None:
                dispatches += out
                free = [w for w in free if w not in chosen]
                continue
            # Lost a race for a worker or the job (another scheduler, a cancel): the
            # next pass sees the new state.
            free = [w for w in free if w not in chosen]
            continue
        else:
            pools = _by_kind(free)
            most = max(pools.values(), key=len, default=[])
            if waiting_ahead:
                reason = f"queued behind {_plural(waiting_ahead, 'job')}"
            elif len(free) >= n:
                reason = (
                    f"needs {_plural(n, 'worker')} of one kind, {len(free)} idle but at most "
                    f"{len(most)} of one kind"
                )
            else:
                reason = f"needs {_plural(n, 'worker')}, {len(free)} idle"
            waited = (now - job.created_at).total_seconds()
            if waited > reserve_after_s:
                # Starvation guard: keep the idle workers it needs for it (of the kind
                # closest to enough).
                kept = set(map(id, most[:n]))
                free = [w for w in free if id(w) not in kept]
                reason += " (reserving workers)"
            waiting_ahead += 1
        if reason is not None and job.pending_reason != reason:
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.state == QUEUED)
                .values(pending_reason=reason)
                .execution_options(synchronize_session=False)
            )
    return dispatches


def queued_count(session: Session) -> int:
    return int(
        session.scalar(select(func.count()).select_from(Job).where(Job.state == QUEUED)) or 0
    )


def resend_due(last_sent: dict[int, datetime], assignment_id: int, every_s: float) -> bool:
    """Whether the reconciler should re-send an unclaimed assignment now (at most every
    `every_s` seconds each), updating `last_sent`."""
    now = utcnow()
    prev = last_sent.get(assignment_id)
    if prev is not None and now - prev < timedelta(seconds=every_s):
        return False
    last_sent[assignment_id] = now
    return True
