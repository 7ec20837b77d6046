"""The scheduling policy, pure (no database): which queued job goes to which idle workers,
and why the others wait.

A gang is of one kind: all CPU workers, or all GPUs of one model (as nvidia-smi names it;
GPUs of unknown name go together). A CPU rank would pick gloo where the GPU ranks pick
NCCL and the rendezvous would hang, and a mixed-model gang runs at its slowest card's pace
and can resolve `precision: auto` differently.

Order: priority first; among equal priorities, fair share in two levels (projects, then
users: decayed usage over share, `scheduler/fairshare.py`); within a user, age. A job
that would take its user or its project past their `max_workers` quota waits and takes
nothing from anyone.

Backfill policy. Jobs are considered in that order. A job
that does not fit in the idle workers now does not stop smaller jobs behind it from
starting on the idle workers that are left (backfill), so a big job never blocks the
queue. To keep a big job from starving behind a stream of small ones, a job that has
waited longer than `reserve_after_s` reserves the idle workers it needs: from then on
workers that become idle accumulate for it and jobs behind it get only what is left
over. A job that asks for more workers than are registered and live cannot be helped by
waiting, so it never reserves (its reason says how many are registered).

Warm placement. A one-rank job starts on its worker's warm trainer when that has finished
its imports (`FreeWorker.warm`, workers.warm_since: worker/standby.py), ~3 s sooner than a
cold start; a gang's ranks always start cold (torchrun). So within the kind a job gets, a
one-rank job takes a warm idle worker before any cold one (of the warm ones, on the host
with the fewest idle workers, as below), and a gang takes the hosts it would take anyway
but, on each, its cold workers first: warm ones stay for the one-rank jobs behind it.

Cost: idle workers are kept per kind and host and hosts bucketed by idle count (and, for
warm ones, by idle count again), never rescanned per job, so a pass over a thousand idle
workers plans in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from torchyard.contracts.plurals import plural
from torchyard.scheduler.fairshare import FairShare
from torchyard.store.queue import FreeWorker, QueuedJob

RESERVE_AFTER_S = 300.0

Kind = tuple[str, str]


def kind_of(device: str, device_name: str | None) -> Kind:
    """Workers of one kind may share a job: ("cpu", "") or ("cuda", GPU model)."""
    return ("cuda", device_name or "") if device == "cuda" else ("cpu", "")


def describe_kind(k: Kind) -> str:
    return "cpu" if k[0] == "cpu" else (k[1] or "gpu")


class Pools:
    """The idle workers by kind, then host, each host's list in id order; taking workers
    removes them. Hosts keep the order they came in (host name order from the store), which
    breaks ties the same way every pass. Per kind, hosts are also bucketed by how many idle
    workers they have, so picking a host costs the size of one bucket, not every host."""

    def __init__(self, free: Iterable[FreeWorker]):
        self.hosts: dict[Kind, dict[str, list[FreeWorker]]] = {}
        self.size: dict[Kind, int] = {}
        self.order: dict[str, int] = {}  # host -> its place in the store's order
        for w in free:
            k = kind_of(w.device, w.device_name)
            self.hosts.setdefault(k, {}).setdefault(w.host, []).append(w)
            self.size[k] = self.size.get(k, 0) + 1
            self.order.setdefault(w.host, len(self.order))
        # kind -> idle count -> hosts with exactly that many idle workers
        self.buckets: dict[Kind, dict[int, set[str]]] = {}
        # kind -> host -> its warm idle workers (hosts with none are absent), and the same
        # buckets as above for the hosts with a warm idle worker only
        self.warm: dict[Kind, dict[str, int]] = {}
        self.warm_buckets: dict[Kind, dict[int, set[str]]] = {}
        for k, hosts in self.hosts.items():
            for h, ws in hosts.items():
                self.buckets.setdefault(k, {}).setdefault(len(ws), set()).add(h)
                if warm := sum(1 for w in ws if w.warm):
                    self.warm.setdefault(k, {})[h] = warm
                    self.warm_buckets.setdefault(k, {}).setdefault(len(ws), set()).add(h)

    def total(self) -> int:
        return sum(self.size.values())

    def largest(self) -> tuple[Kind | None, int]:
        """The kind with the most idle workers (the lowest kind on a tie), and how many."""
        if not self.size:
            return None, 0
        best = min(self.size, key=lambda k: (-self.size[k], k))
        return best, self.size[best]

    def take_gang(self, n: int) -> list[FreeWorker] | None:
        """n idle workers of one kind (the kind with the fewest idle that still fits,
        keeping big pools whole for big jobs; the lowest kind on a tie, so the choice never
        depends on which workers came first), or None if no kind has n idle."""
        fitting = [k for k, size in self.size.items() if size >= n]
        if not fitting:
            return None
        return self._take(min(fitting, key=lambda k: (self.size[k], k)), n)

    def _take(self, k: Kind, n: int) -> list[FreeWorker]:
        """One rank: a warm worker when there is one (see the module docstring). Otherwise
        all on one host when a host has enough (the one with the fewest idle that still
        fits, keeping big hosts whole for big jobs), else from the hosts with most idle
        workers first (fewest hosts spanned); on each host, cold workers first."""
        if n == 1 and (host := self._fewest(self.warm_buckets.get(k, {}), 1)) is not None:
            return self._remove(k, [host], 1, warm_first=True)
        buckets = self.buckets[k]
        if (host := self._fewest(buckets, n)) is not None:
            order = [host]
        else:
            order = [h for c in sorted(buckets, reverse=True)
                     for h in sorted(buckets[c], key=self.order.__getitem__)]  # fmt: skip
        return self._remove(k, order, n)

    def _fewest(self, buckets: dict[int, set[str]], n: int) -> str | None:
        """The host with the fewest idle workers that still has n (the first in the store's
        order on a tie), or None."""
        fits = [c for c, hs in buckets.items() if c >= n and hs]
        return min(buckets[min(fits)], key=self.order.__getitem__) if fits else None

    def reserve(self, k: Kind, n: int) -> None:
        """Hold back n idle workers of kind k (in host order, cold ones first on each host,
        warm ones last: they are what a one-rank job behind it can still use) for a
        waiting job."""
        self._remove(k, list(self.hosts[k]), n)

    def _remove(
        self, k: Kind, hosts: list[str], n: int, warm_first: bool = False
    ) -> list[FreeWorker]:
        chosen: list[FreeWorker] = []
        warm = self.warm.get(k, {})
        for h in hosts:
            if len(chosen) == n:
                break
            ws = self.hosts[k][h]
            got, rest = _pick(ws, n - len(chosen), warm_first if h in warm else None)
            self.buckets[k][len(ws)].discard(h)
            if not rest:
                del self.hosts[k][h]  # keeps the order of the others; never scanned again
            else:
                self.hosts[k][h] = rest
                self.buckets[k].setdefault(len(rest), set()).add(h)
            if h in warm:
                self._rewarm(k, h, len(ws), rest, warm[h] - sum(1 for w in got if w.warm))
            chosen += got
        self.size[k] -= len(chosen)
        return chosen

    def _rewarm(self, k: Kind, h: str, before: int, rest: list[FreeWorker], left: int) -> None:
        """Host h of kind k went from `before` idle workers to `rest`, `left` of them warm."""
        self.warm_buckets[k][before].discard(h)
        if left:
            self.warm[k][h] = left
            self.warm_buckets[k].setdefault(len(rest), set()).add(h)
        else:
            del self.warm[k][h]


def _pick(
    ws: list[FreeWorker], m: int, warm_first: bool | None
) -> tuple[list[FreeWorker], list[FreeWorker]]:
    """m of a host's idle workers and the rest, both in id order: the first m, or with
    `warm_first` set (the host has a warm one), the warm (True) or cold (False) ones first."""
    if warm_first is None or m >= len(ws):
        return ws[:m], ws[m:]
    first = [w for w in ws if w.warm == warm_first]
    taken = {w.id for w in (first + [w for w in ws if w.warm != warm_first])[:m]}
    return [w for w in ws if w.id in taken], [w for w in ws if w.id not in taken]


@dataclass
class Plan:
    """What one pass does: gangs to start, in queue order, and new pending reasons; the
    jobs that wait although they could run on this cluster (in order) and the idle
    workers left, for preemption to look at."""

    gangs: list[tuple[QueuedJob, list[FreeWorker]]] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    waiting: list[QueuedJob] = field(default_factory=list)
    left: Pools | None = None
    truncated: bool = False  # stopped at max_ranks: the jobs after were not considered


def cluster_reason(n: int, live_kinds: dict[Kind, int]) -> str | None:
    """Why a job of world size n cannot run on this cluster at all, or None if it can."""
    live = sum(live_kinds.values())
    if live == 0:
        return "no worker registered"
    if n > live:
        return f"needs {plural(n, 'worker')}, {live} registered"
    if n > max(live_kinds.values()):
        kinds = ", ".join(f"{c} {describe_kind(k)}" for k, c in sorted(live_kinds.items(), key=str))
        return (
            f"needs {plural(n, 'worker')} of one kind (a job never mixes CPU and GPU "
            f"workers or GPU models); registered: {kinds}"
        )
    return None


def wait_reason(n: int, pools: Pools, waiting_ahead: int) -> str:
    """Why a job that could run on this cluster waits now."""
    if waiting_ahead:
        return f"queued behind {plural(waiting_ahead, 'job')}"
    idle = pools.total()
    if idle >= n:
        return (
            f"needs {plural(n, 'worker')} of one kind, {idle} idle but at most "
            f"{pools.largest()[1]} of one kind"
        )
    return f"needs {plural(n, 'worker')}, {idle} idle"


def plan(
    jobs: list[QueuedJob],
    free: list[FreeWorker],
    live_kinds: dict[Kind, int],
    *,
    now: datetime,
    reserve_after_s: float = RESERVE_AFTER_S,
    share: FairShare | None = None,
    max_ranks: int | None = None,
) -> Plan:
    """Walk the queue in fair-share order: start what fits (gang, backfill) within each
    user's and project's max_workers, give the rest a reason, and let a job that waited past
    `reserve_after_s`, or whose preemption is under way, reserve workers. With
    `max_ranks`, stop once that many ranks are placed (`truncated`): what was planned so
    far is exactly what an unbounded plan starts first, so the next pass continues it."""
    share = share or FairShare()
    out = Plan()
    pools = Pools(free)
    waiting_ahead = 0  # jobs earlier in the order that wait and could run on this cluster
    placed = 0
    for job in share.order(jobs):
        if max_ranks is not None and placed >= max_ranks:
            out.truncated = True
            break
        n = job.world_size
        reason = cluster_reason(n, live_kinds) or share.quota_reason(job)
        if reason is None:
            if job.id in share.preempting:
                reason = share.preempting_reason(job.id)
                _reserve(pools, n)
            elif (chosen := pools.take_gang(n)) is not None:
                out.gangs.append((job, chosen))
                share.started(job)
                placed += n
                continue
            else:
                reason = share.wait_prefix(job) + wait_reason(n, pools, waiting_ahead)
                if (now - job.created_at).total_seconds() > reserve_after_s:
                    # Starvation guard: keep the idle workers it needs for it.
                    _reserve(pools, n)
                    reason += " (reserving workers)"
                out.waiting.append(job)
            share.waits(job)
            waiting_ahead += 1
        if job.pending_reason != reason:
            out.reasons[job.id] = reason
    out.left = pools
    return out


def _reserve(pools: Pools, n: int) -> None:
    """Hold back up to n idle workers (of the kind closest to enough) for a waiting job."""
    kind, idle = pools.largest()
    if kind is not None:
        pools.reserve(kind, min(n, idle))
