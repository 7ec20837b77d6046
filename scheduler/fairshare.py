"""Fair share and quotas for one scheduling pass (pure: the store reads are the caller's).

Among jobs of equal priority, users go in order of their recent usage (decayed
worker-seconds, `store/usage.py`) divided by their share, so the user who has used the
pool least lately goes first; within a user, priority then age. The order is fixed at
the start of a pass from the usage read then (passes run every few seconds and on every
job end, so one pass that starts many jobs is the only place it is coarse).

A user's `max_workers` counts the workers their jobs hold now plus those this pass gives
them; a job that would go past it waits with a reason naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchyard.store.pool import PoolUser
from torchyard.store.queue import QueuedJob


def describe_duration(seconds: float) -> str:
    for unit, size in (("day", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if unit == 'day' and n != 1 else ''}"
    return f"{seconds:g} s"


@dataclass
class FairShare:
    users: dict[int, PoolUser] = field(default_factory=dict)
    usage: dict[int, float] = field(default_factory=dict)  # decayed worker-seconds
    held: dict[int, int] = field(default_factory=dict)  # workers each user's jobs hold
    preempting: dict[str, list[str]] = field(default_factory=dict)  # job -> victims stopping
    half_life_s: float = 86_400.0
    unit: str = "worker"  # what one worker is: "GPU", "CPU slot" or "worker" (mixed)
    # owners with a job earlier in this pass's order, per priority
    _ahead: dict[int, set[int]] = field(default_factory=dict)

    def name(self, uid: int) -> str:
        u = self.users.get(uid)
        return u.name if u is not None else f"user {uid}"

    def normalized(self, uid: int) -> float:
        u = self.users.get(uid)
        share = u.share if u is not None and u.share > 0 else 1.0
        return self.usage.get(uid, 0.0) / share

    def order(self, jobs: list[QueuedJob]) -> list[QueuedJob]:
        return sorted(
            jobs, key=lambda j: (-j.priority, self.normalized(j.owner_id), j.created_at, j.id)
        )

    def quota_reason(self, job: QueuedJob) -> str | None:
        u = self.users.get(job.owner_id)
        if u is None or u.max_workers is None:
            return None
        n, cap, held = job.world_size, u.max_workers, self.held.get(job.owner_id, 0)
        if n > cap:
            return (
                f"quota: needs {n} workers but {u.name}'s max_workers is {cap}; "
                "it cannot start unless an admin raises the quota"
            )
        if held + n > cap:
            return f"quota: {u.name}'s jobs hold {held} of max_workers {cap}, this one needs {n}"
        return None

    def started(self, job: QueuedJob) -> None:
        self.held[job.owner_id] = self.held.get(job.owner_id, 0) + job.world_size
        self.waits(job)

    def waits(self, job: QueuedJob) -> None:
        self._ahead.setdefault(job.priority, set()).add(job.owner_id)

    def hours(self, uid: int) -> str:
        return f"{self.usage.get(uid, 0.0) / 3600:.1f}"

    def wait_prefix(self, job: QueuedJob) -> str:
        """ "fair share: …; " when a job of another user at the same priority went first
        because that user used less, else ""."""
        me = job.owner_id
        others = [
            o
            for o in self._ahead.get(job.priority, ())
            if o != me and self.normalized(o) < self.normalized(me)
        ]
        if not others:
            return ""
        o = min(others, key=self.normalized)
        plain = all(self.users.get(u, _ONE).share == 1 for u in (me, o))

        def share(uid: int) -> str:
            return "" if plain else f" (share {self.users.get(uid, _ONE).share:g})"

        return (
            f"fair share: {self.name(me)} has used {self.hours(me)} {self.unit}-h{share(me)}, "
            f"{self.name(o)} {self.hours(o)}{share(o)} "
            f"(half-life {describe_duration(self.half_life_s)}); "
        )

    def preempting_reason(self, job_id: str) -> str:
        victims = self.preempting.get(job_id, [])
        jobs = "job " if len(victims) == 1 else "jobs "
        return f"waiting for preempted {jobs}{', '.join(victims)} to stop (reserving workers)"


_ONE = PoolUser(0, "", 1.0, None)
