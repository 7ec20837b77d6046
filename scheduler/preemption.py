"""Which running jobs a waiting job preempts (pure: no database).

A queued job that has waited `preempt_after_s` and still does not fit preempts running
jobs of lower priority that allow it (`preemptible`) and that it may take (`may_take`):

- its own user's jobs of lower priority: a user orders their own work;
- another user's job only when the waiting job's priority is also above that user's
  `max_priority` (store/quotas.py; default 0). Priority is a permission: a user's
  max_priority caps the priority they may submit at (admins are not capped) and protects
  their running jobs up to it, so with the defaults nobody preempts anybody else, and an
  admin who gives one user a higher max_priority than another's lets that user's urgent
  jobs (and only those above the other's limit) take the other's workers. A user cannot
  make their own work preemptible by others by giving it a low priority: it stays
  protected up to their max_priority.

Among the jobs it may take: of one worker kind (a gang never
mixes kinds), the fewest jobs, then the lowest priorities, then the most recently started
(the least work since their last checkpoint is the usual bet). Jobs are taken greedily in
(priority, newest first) order until enough workers would be free, then any taken job the
others already cover is given back, highest priority first. Among kinds, the one that
needs the fewest victims wins.

A preemptor reserves the idle workers of its kind at once, so the workers its victims free
are not taken by backfill on the way; later passes see the preemption in flight
(`attempts.preempted_by`) and keep reserving until it starts.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import NamedTuple

from torchyard.contracts.plurals import plural
from torchyard.scheduler.policy import Kind, Pools, kind_of
from torchyard.store.pool import Preemption, RunningGang
from torchyard.store.queue import QueuedJob

_EPOCH = datetime.min.replace(tzinfo=UTC)


class Choice(NamedTuple):
    preemptions: list[Preemption]
    reasons: dict[str, str]


def will_preempt(reason: str | None, victims: list[str], at: datetime, in_s: float) -> str:
    """The reason of a job that may preempt once it has waited TORCHYARD_PREEMPT_AFTER_S:
    why it waits now, then which jobs it will stop (`<id> (priority N)`, the form
    api/views.py hides from other users) and when."""
    jobs = plural(len(victims), "job")
    when = f"{at.astimezone(UTC):%H:%M:%S} UTC, in {math.ceil(in_s)}s"
    return (
        f"{reason or 'waiting for a worker'}; will preempt {jobs}: {', '.join(victims)} at "
        f"{when} (TORCHYARD_PREEMPT_AFTER_S) unless a worker frees up first"
    )


def eligible(waiting: list[QueuedJob], now: datetime, after_s: float) -> list[QueuedJob]:
    return [j for j in waiting if (now - j.created_at).total_seconds() >= after_s]


def may_take(job: QueuedJob, gang: RunningGang) -> bool:
    """Whether `job` may preempt `gang` (the gang is preemptible: the store read only
    those): a lower priority, and for another user's job a priority above that user's
    max_priority too."""
    if gang.priority >= job.priority:
        return False
    return gang.owner_id == job.owner_id or job.priority > gang.owner_max_priority


def _victims_of_kind(
    job: QueuedJob, need: int, gangs: list[RunningGang]
) -> list[RunningGang] | None:
    """The fewest gangs (of one kind, already filtered) that free `need` workers; among
    sets of that size, the lowest priorities, then the most recently started."""
    cands = [g for g in gangs if may_take(job, g)]
    fewest, freed = 0, 0
    for size in sorted((g.workers for g in cands), reverse=True):  # biggest first: fewest
        if freed >= need:
            break
        fewest, freed = fewest + 1, freed + size
    if freed < need:
        return None
    pref = sorted(cands, key=lambda g: (g.priority, -(g.started_at or _EPOCH).timestamp()))
    chosen: list[RunningGang] = []
    left = need
    for i, g in enumerate(pref):
        if left <= 0:
            break
        # Take g only if the slots left can still be filled from the gangs after it.
        slots = fewest - len(chosen) - 1
        cover = sum(sorted((x.workers for x in pref[i + 1 :]), reverse=True)[:slots])
        if g.workers + cover >= left:
            chosen.append(g)
            left -= g.workers
    return chosen


def choose(
    waiting: list[QueuedJob],
    pools: Pools,
    running: list[RunningGang],
    live_kinds: dict[Kind, int],
) -> Choice:
    """Victims for each eligible waiting job, in queue order; a gang is taken once."""
    out = Choice([], {})
    taken: set[str] = set()
    for job in waiting:
        best: tuple[Kind, list[RunningGang]] | None = None
        for kind, live in live_kinds.items():
            if live < job.world_size:
                continue
            gangs = [
                g
                for g in running
                if g.job_id not in taken and kind_of(g.device, g.device_name) == kind
            ]
            need = job.world_size - pools.size.get(kind, 0)
            victims = _victims_of_kind(job, need, gangs) if need > 0 else None
            if victims and (
                best is None
                or (len(victims), max(v.priority for v in victims))
                < (len(best[1]), max(v.priority for v in best[1]))
            ):
                best = (kind, victims)
        if best is None:
            continue
        kind, victims = best
        if pools.size.get(kind, 0):
            pools.reserve(kind, pools.size[kind])
        taken.update(v.job_id for v in victims)
        out.preemptions.extend(Preemption(v.job_id, v.attempt_id, job.id) for v in victims)
        names = ", ".join(f"{v.job_id} (priority {v.priority})" for v in victims)
        out.reasons[job.id] = (
            f"preempting {plural(len(victims), 'job')} for {plural(job.world_size, 'worker')}: "
            f"{names} (reserving workers)"
        )
    return out
