"""One scheduling pass: read the idle workers and each user's queue head, plan with
`scheduler/policy.py` (fair share and quotas from `scheduler/fairshare.py`), pick victims
for jobs that waited long enough behind lower-priority ones (`scheduler/preemption.py`),
write the result in one batch (`store/queue.py`, `store/pool.py`), and return the
messages to send once the caller has committed.

Only as many queued jobs of each user are read as could be placed on the idle workers
(every job takes at least one), plus `LOOKAHEAD` more so that small jobs behind big
waiting ones still backfill and the jobs at the head of a full cluster's queue get their
pending reason. The extra reads fair share, quotas and preemption need are made only when
they can matter: users' usage when two users (or a user's team and personal work) have
jobs queued, team projects' usage when a team project competes with another project or
user, held workers when a user or a project of a queued job has a max_workers quota,
running gangs when a job waited long enough and outranks one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy.orm import Session

from torchyard.scheduler import preemption
from torchyard.scheduler.fairshare import Entry, FairShare
from torchyard.scheduler.policy import RESERVE_AFTER_S, Kind, Plan, kind_of, plan
from torchyard.store.dialect import db_now
from torchyard.store.models import utcnow
from torchyard.store.pool import (
    held_by_owner,
    held_by_project,
    lowest_preemptible_priority,
    pool_projects,
    pool_users,
    preempt,
    preemptions_in_flight,
    running_gangs,
)
from torchyard.store.queue import (
    QueuedJob,
    idle_workers,
    live_counts,
    queue_heads,
    set_pending_reasons,
    start_gangs,
)
from torchyard.store.usage import usage_by_project, usage_by_user
from torchyard.store.workers import stale_cutoff

LOOKAHEAD = 200
# A pass starts at most this many ranks (plus the rest of the gang that crosses it), then
# commits and sends; the caller runs the next pass at once (`PassResult.more`). Filling an
# idle cluster of thousands of workers thus takes several short transactions, not one long
# one: the first jobs' messages go out sooner, and the workers' rows are locked briefly.
MAX_RANKS_PER_PASS = 256


@dataclass(frozen=True)
class PoolPolicy:
    """The pool-sharing knobs (TORCHYARD_PREEMPT_AFTER_S, TORCHYARD_FAIRSHARE_HALF_LIFE_S)."""

    preempt_after_s: float = 30.0
    half_life_s: float = 86_400.0


class Dispatch(NamedTuple):
    """One message to send after the pass commits: RUN_TASK(assignment_id) to `queue`."""

    job_id: str
    assignment_id: int
    worker_id: str
    queue: str
    rank: int


class PassResult(NamedTuple):
    dispatches: list[Dispatch]
    more: bool  # the pass stopped at max_ranks with jobs left to consider: run another now


def fair_share(
    session: Session,
    jobs: list[QueuedJob],
    live_kinds: dict[Kind, int],
    now: datetime,
    half_life_s: float,
) -> FairShare:
    """What fair share and quotas need to know about the users and projects with queued
    jobs: usage only when two of them compete, held workers only where a limit is set."""
    fs = _pool_view(session, jobs, live_kinds, half_life_s)
    entries = {fs.entry(j) for j in jobs}
    if len(fs.users) > 1 or len(entries) > 1:
        fs.usage = usage_by_user(session, now, half_life_s, fs.users)
    tops = {e if e[0] is None else (e[0], 0) for e in entries}  # first-level terms
    if len(tops) > 1:
        _read_project_usage(session, fs, entries, now)
    if any(u.max_workers is not None for u in fs.users.values()):
        fs.held = held_by_owner(session)
    limited = {p.id for p in fs.projects.values() if p.max_workers is not None}
    if limited:
        fs.project_held = held_by_project(session, limited)
    fs.preempting = preemptions_in_flight(session)
    return fs


def _pool_view(
    session: Session, jobs: list[QueuedJob], live_kinds: dict[Kind, int], half_life_s: float
) -> FairShare:
    """The owners and the projects of `jobs`, read (two small queries), no usage yet."""
    owners = {j.owner_id for j in jobs}
    projects = {j.project_id for j in jobs if j.project_id is not None}
    return FairShare(
        users=pool_users(session, owners),
        projects=pool_projects(session, projects),
        half_life_s=half_life_s,
        unit=unit_of(live_kinds),
    )


def _read_project_usage(
    session: Session, fs: FairShare, entries: set[Entry], now: datetime
) -> None:
    """The team projects' usage, in one aggregate (personal projects use their user's)."""
    teams = {team for team, _ in entries if team is not None}
    if teams:
        fs.project_usage = usage_by_project(session, now, fs.half_life_s, teams)


def live_by_kind(session: Session, cutoff: datetime) -> dict[Kind, int]:
    """Live workers (idle or busy, fresh heartbeat) per kind."""
    out: dict[Kind, int] = {}
    for device, name, count in live_counts(session, cutoff):
        k = kind_of(device, name)
        out[k] = out.get(k, 0) + count
    return out


def unit_of(live_kinds: dict[Kind, int]) -> str:
    devices = {k[0] for k in live_kinds}
    return {frozenset({"cuda"}): "GPU", frozenset({"cpu"}): "CPU slot"}.get(
        frozenset(devices), "worker"
    )


def _preempt(
    session: Session,
    p: Plan,
    live_kinds: dict[Kind, int],
    now: datetime,
    after_s: float,
) -> None:
    """Choose and ask victims for the waiting jobs that may preempt; their reasons say so.
    A job that will be able to once it has waited `after_s` hears which jobs and when."""
    if not p.waiting or p.left is None:
        return
    ready = preemption.eligible(p.waiting, now, after_s)
    lowest = lowest_preemptible_priority(session)
    top = max(j.priority for j in p.waiting)
    if lowest is None or lowest >= top:
        return
    gangs = running_gangs(session, top)
    soon = [j for j in p.waiting if j not in ready]
    left = copy.deepcopy(p.left) if soon else p.left  # the dry run below must not reserve
    taken: set[str] = set()
    if ready:
        choice = preemption.choose(ready, p.left, gangs, live_kinds)
        asked = {v.by_job_id for v in preempt(session, choice.preemptions)}
        p.reasons.update({j: r for j, r in choice.reasons.items() if j in asked})
        taken = {v.victim_job_id for v in choice.preemptions}
    if soon:
        free = [g for g in gangs if g.job_id not in taken]
        priority = {g.job_id: g.priority for g in free}
        dry = preemption.choose(soon, left, free, live_kinds)
        for job in soon:
            victims = [
                f"{v.victim_job_id} (priority {priority[v.victim_job_id]})"
                for v in dry.preemptions
                if v.by_job_id == job.id
            ]
            if victims:
                at = job.created_at + timedelta(seconds=after_s)
                p.reasons[job.id] = preemption.will_preempt(
                    p.reasons.get(job.id), victims, at, max(0.0, (at - now).total_seconds())
                )


def schedule(
    session: Session,
    *,
    heartbeat_timeout_s: float,
    reserve_after_s: float = RESERVE_AFTER_S,
    pool: PoolPolicy | None = None,
    now: datetime | None = None,
) -> list[Dispatch]:
    """One unbounded pass (`run_pass` without max_ranks): everything that fits starts."""
    return run_pass(
        session,
        heartbeat_timeout_s=heartbeat_timeout_s,
        reserve_after_s=reserve_after_s,
        pool=pool,
        now=now,
        max_ranks=None,
    ).dispatches


def run_pass(
    session: Session,
    *,
    heartbeat_timeout_s: float,
    reserve_after_s: float = RESERVE_AFTER_S,
    pool: PoolPolicy | None = None,
    now: datetime | None = None,
    max_ranks: int | None = MAX_RANKS_PER_PASS,
) -> PassResult:
    """Run one pass in the caller's transaction; the caller commits, then sends the
    returned dispatches (never before: a worker must find its assignment in the store),
    then runs the next pass at once if `more`. A pass that lost a race (a row changed
    under it) writes nothing and returns no dispatches: the next pass sees the new state."""
    pool = pool or PoolPolicy()
    now = now or db_now(session)
    cutoff = stale_cutoff(session, heartbeat_timeout_s, now)
    free = idle_workers(session, cutoff)
    # Every started job takes a worker at least, so no more than this many of a user's
    # jobs can start; LOOKAHEAD more let small jobs behind waiting big ones backfill.
    placeable = len(free) if max_ranks is None else min(len(free), max_ranks)
    jobs = queue_heads(session, placeable + LOOKAHEAD)
    if not jobs:
        return PassResult([], False)
    live_kinds = live_by_kind(session, cutoff)
    fs = fair_share(session, jobs, live_kinds, now, pool.half_life_s)
    p = plan(
        jobs,
        free,
        live_kinds,
        now=now,
        reserve_after_s=reserve_after_s,
        share=fs,
        max_ranks=max_ranks,
    )
    started = start_gangs(session, p.gangs)
    if started is None:
        return PassResult([], False)
    if not p.truncated:  # else the idle workers left are the next pass's to place first
        _preempt(session, p, live_kinds, now, pool.preempt_after_s)
    set_pending_reasons(session, p.reasons)
    return PassResult([Dispatch(*s) for s in started], p.truncated)


def resend_due(last_sent: dict[int, datetime], assignment_id: int, every_s: float) -> bool:
    """Whether the reconciler should re-send an unclaimed assignment now (at most every
    `every_s` seconds each), updating `last_sent`."""
    t = utcnow()
    prev = last_sent.get(assignment_id)
    if prev is not None and t - prev < timedelta(seconds=every_s):
        return False
    last_sent[assignment_id] = t
    return True


class QueueEntry(NamedTuple):
    position: int  # 1 = the next to start
    job: QueuedJob
    owner: str
    usage_s: float  # the owner's decayed worker-seconds


def queue_order(
    session: Session, half_life_s: float, heartbeat_timeout_s: float, *, per_user: int = 1000
) -> tuple[list[QueueEntry], FairShare]:
    """The queued jobs in the order a pass would consider them now (at most `per_user` of
    each user), for GET /v1/queue; each keeps the pending reason the last pass wrote."""
    jobs = queue_heads(session, per_user, lock=False)
    now = db_now(session)
    cutoff = stale_cutoff(session, heartbeat_timeout_s, now)
    fs = _pool_view(session, jobs, live_by_kind(session, cutoff), half_life_s)
    fs.usage = usage_by_user(session, now, half_life_s, fs.users)
    _read_project_usage(session, fs, {fs.entry(j) for j in jobs}, now)
    return [
        QueueEntry(i, j, fs.name(j.owner_id), fs.usage.get(j.owner_id, 0.0))
        for i, j in enumerate(fs.order(jobs), start=1)
    ], fs
