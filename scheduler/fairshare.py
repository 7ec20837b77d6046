"""Fair share and quotas for one scheduling pass (pure: the store reads are the caller's).

Fair share has two levels (store/quotas.py: how users' and projects' quotas combine).
Among jobs of equal priority the pass orders first by the job's project: a team project's
recent usage (decayed worker-seconds of all its jobs, whoever submitted them,
`store/usage.py`) divided by the project's share; a personal project (or a job without
one) stands for its user, so its term is the user's usage divided by the user's share.
Then by the user's usage (their jobs in every project) divided by the user's share; then
age. With only personal projects both terms are the user's own: the order is per-user
fair share, as before projects. The order is fixed at the start of a pass from the usage
read then (passes run every few seconds and on every job end, so one pass that starts
many jobs is the only place it is coarse).

`max_workers` holds at two levels too: a job starts only if it fits under its user's
limit (the workers their jobs hold anywhere) and its project's (the workers all the
project's jobs hold), counting what this pass has already given. A job held back waits
with a reason naming the limit: one it can never fit under first, else the one with the
least room left (the user's on a tie).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torchyard.contracts.plurals import plural
from torchyard.store.pool import PoolProject, PoolUser
from torchyard.store.queue import QueuedJob

# Who a fair-share term is about: a team project's id, or None for the user themself
# (a personal project), with the user.
Entry = tuple[int | None, int]


class _Limit(NamedTuple):
    who: str  # "alice" or "project lab"
    cap: int
    held: int


class _Term(NamedTuple):
    name: str
    usage_s: float
    share: float


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
    projects: dict[int, PoolProject] = field(default_factory=dict)  # of the queued jobs
    project_usage: dict[int, float] = field(default_factory=dict)  # team projects' usage
    project_held: dict[int, int] = field(default_factory=dict)  # workers each project holds
    # Per priority, the two first (by rank) entries with a job earlier in this pass's
    # order: all wait_prefix needs (the first that is not the waiting job's own), kept so
    # that a pass over thousands of waiting jobs costs O(1) each, whatever the entries.
    _ahead: dict[int, list[tuple[tuple[float, float, int, int], Entry]]] = field(
        default_factory=dict
    )
    _ranks: dict[Entry, tuple[float, float]] = field(default_factory=dict)  # set usage first

    def name(self, uid: int) -> str:
        u = self.users.get(uid)
        return u.name if u is not None else f"user {uid}"

    def normalized(self, uid: int) -> float:
        u = self.users.get(uid)
        share = u.share if u is not None and u.share > 0 else 1.0
        return self.usage.get(uid, 0.0) / share

    def team(self, job: QueuedJob) -> int | None:
        """The job's project when it is a team's; None: its user's personal project."""
        p = self.projects.get(job.project_id) if job.project_id is not None else None
        return p.id if p is not None and p.personal_of is None else None

    def entry(self, job: QueuedJob) -> Entry:
        return (self.team(job), job.owner_id)

    def top(self, e: Entry) -> float:
        """The first-level term: the team project's usage over its share, or the user's."""
        team, uid = e
        if team is None:
            return self.normalized(uid)
        share = self.projects[team].share
        return self.project_usage.get(team, 0.0) / (share if share > 0 else 1.0)

    def rank(self, e: Entry) -> tuple[float, float]:
        """(first-level term, user term), computed once a pass (usage is read before)."""
        r = self._ranks.get(e)
        if r is None:
            r = self._ranks[e] = (self.top(e), self.normalized(e[1]))
        return r

    def order(self, jobs: list[QueuedJob]) -> list[QueuedJob]:
        return sorted(
            jobs, key=lambda j: (-j.priority, *self.rank(self.entry(j)), j.created_at, j.id)
        )

    def _limits(self, job: QueuedJob) -> list[_Limit]:
        """The job's max_workers limits: its user's, then its project's."""
        out = []
        u = self.users.get(job.owner_id)
        if u is not None and u.max_workers is not None:
            out.append(_Limit(u.name, u.max_workers, self.held.get(job.owner_id, 0)))
        p = self.projects.get(job.project_id) if job.project_id is not None else None
        if p is not None and p.max_workers is not None:
            out.append(_Limit(f"project {p.name}", p.max_workers, self.project_held.get(p.id, 0)))
        return out

    def quota_reason(self, job: QueuedJob) -> str | None:
        n, limits = job.world_size, self._limits(job)
        if never := [lim for lim in limits if n > lim.cap]:
            lim = min(never, key=lambda x: x.cap)
            return (
                f"quota: needs {plural(n, 'worker')} but {lim.who}'s max_workers is {lim.cap}; "
                "it cannot start unless an admin raises the quota"
            )
        if full := [lim for lim in limits if lim.held + n > lim.cap]:
            lim = min(full, key=lambda x: x.cap - x.held)  # least room; a tie: the user's
            return (
                f"quota: {lim.who}'s jobs hold {lim.held} of max_workers {lim.cap}, "
                f"this one needs {n}"
            )
        return None

    def started(self, job: QueuedJob) -> None:
        self.held[job.owner_id] = self.held.get(job.owner_id, 0) + job.world_size
        if job.project_id is not None:
            pid = job.project_id
            self.project_held[pid] = self.project_held.get(pid, 0) + job.world_size
        self.waits(job)

    def waits(self, job: QueuedJob) -> None:
        e = self.entry(job)
        first = self._ahead.setdefault(job.priority, [])
        if all(x != e for _, x in first):
            first.append(((*self.rank(e), e[1], -1 if e[0] is None else e[0]), e))
            first.sort()
            del first[2:]

    def _term(self, e: Entry, by_user: bool) -> _Term:
        team, uid = e
        if team is None or by_user:
            share = self.users.get(uid, _ONE).share
            return _Term(self.name(uid), self.usage.get(uid, 0.0), share)
        p = self.projects[team]
        return _Term(f"project {p.name}", self.project_usage.get(team, 0.0), p.share)

    def wait_prefix(self, job: QueuedJob) -> str:
        """ "fair share: …; " when a job at the same priority went first because its
        project (or user) used less, else "". It names the job's own project or user first:
        api/views.py's owner_reason keeps that part and drops the other's."""
        me = self.entry(job)
        mine = self.rank(me)
        o = next((e for _, e in self._ahead.get(job.priority, ()) if e != me), None)
        if o is None or not self.rank(o) < mine:
            return ""
        by_user = not self.rank(o)[0] < mine[0]  # the same first-level term: users differ
        a, b = self._term(me, by_user), self._term(o, by_user)
        plain = a.share == 1 and b.share == 1

        def share(t: _Term) -> str:
            return "" if plain else f" (share {t.share:g})"

        return (
            f"fair share: {a.name} has used {a.usage_s / 3600:.1f} {self.unit}-h{share(a)}, "
            f"{b.name} {b.usage_s / 3600:.1f}{share(b)} "
            f"(half-life {describe_duration(self.half_life_s)}); "
        )

    def preempting_reason(self, job_id: str) -> str:
        victims = self.preempting.get(job_id, [])
        jobs = "job " if len(victims) == 1 else "jobs "
        return f"waiting for preempted {jobs}{', '.join(victims)} to stop (reserving workers)"


_ONE = PoolUser(0, "", 1.0, None)
