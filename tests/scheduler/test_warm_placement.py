"""Warm placement (scheduler/policy.py): a one-rank job takes a warm idle worker (its warm
trainer ready, workers.warm_since) before any cold one; a gang keeps the hosts it would take
anyway, cold workers first on each, leaving the warm ones to the one-rank jobs behind it;
a pass still places exactly what bounded passes place. Pure, but for the last test, which
reads the mark from the workers table through a real pass."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import update
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.scheduler.policy import Pools, kind_of, plan
from torchyard.store.db import session_scope
from torchyard.store.models import Worker, utcnow
from torchyard.store.queue import FreeWorker, QueuedJob, idle_workers

NOW = utcnow()


def _w(wid: str, host: str = "h1", warm: bool = False, device: str = "cpu") -> FreeWorker:
    name = None if device == "cpu" else device
    return FreeWorker(wid, host, "cpu" if device == "cpu" else "cuda", name, f"q.{wid}", warm)


def _job(jid: str, n: int, age_s: float = 0.0) -> QueuedJob:
    return QueuedJob(jid, n, NOW - timedelta(seconds=age_s), 1, None)


def _live(free: list[FreeWorker]) -> dict:
    return dict(Counter(kind_of(w.device, w.device_name) for w in free))


def _placed(jobs: list[QueuedJob], free: list[FreeWorker]) -> list[tuple[str, list[str]]]:
    p = plan(jobs, free, _live(free), now=NOW)
    return [(j.id, [w.id for w in ws]) for j, ws in p.gangs]


def test_a_one_rank_job_goes_to_the_warm_worker() -> None:
    free = [_w("a"), _w("b", warm=True)]
    assert _placed([_job("j", 1)], free) == [("j", ["b"])]
    # A warm worker on a bigger host beats a cold one on the host with the fewest idle.
    free = [_w("a", "h1"), _w("b", "h2"), _w("c", "h2", warm=True), _w("d", "h2")]
    assert _placed([_job("j", 1)], free) == [("j", ["c"])]
    # Of the warm ones, the host with the fewest idle (big hosts stay whole), then id order.
    free = [_w("a", "h1", True), _w("b", "h1"), _w("c", "h2", True), _w("d", "h2", True)]
    assert _placed([_job("j", 1), _job("k", 1, 1)], free) == [("k", ["a"]), ("j", ["c"])]
    # Never across kinds: the kind is chosen as before (fewest idle that fits).
    free = [_w("a"), _w("g", warm=True, device="a100"), _w("h", warm=True, device="a100")]
    assert _placed([_job("j", 1)], free) == [("j", ["a"])]


def test_a_gang_leaves_the_warm_worker_to_the_one_rank_job_behind_it() -> None:
    free = [_w("a"), _w("b", warm=True), _w("c")]
    # Its ranks start cold whatever it takes (torchrun), so it takes the cold ones ...
    placed = _placed([_job("gang", 2, 2), _job("one", 1, 1)], free)
    assert placed == [("gang", ["a", "c"]), ("one", ["b"])]
    # ... and where it needs the warm one too, it still gets it, on the one host.
    assert _placed([_job("gang", 3)], free) == [("gang", ["a", "b", "c"])]


def test_host_packing_holds_with_warm_workers() -> None:
    # A 2-rank gang goes to the host with the fewest idle that fits (h2), whatever is warm.
    free = [_w("a", "h1", True), _w("b", "h1", True), _w("c", "h1"),
            _w("d", "h2", True), _w("e", "h2")]  # fmt: skip
    assert _placed([_job("gang", 2)], free) == [("gang", ["d", "e"])]
    # Spanning hosts: the most idle first (all of h2), then h1's cold one, not its warm one.
    free = [_w("a", "h1", True), _w("b", "h1"), _w("c", "h2", True), _w("d", "h2"),
            _w("e", "h2")]  # fmt: skip
    assert _placed([_job("gang", 4)], free) == [("gang", ["c", "d", "e", "b"])]


workers_st = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from(["cpu", "a100"]), st.booleans()), max_size=24
)


def _free(workers: list) -> list[FreeWorker]:
    out = [_w(f"w{i:02d}", f"h{h}", warm, d) for i, (h, d, warm) in enumerate(workers)]
    return sorted(out, key=lambda w: (w.host, w.id))


@settings(max_examples=200, deadline=None)
@given(workers=workers_st, sizes=st.lists(st.integers(1, 6), max_size=8))
def test_gangs_take_the_hosts_they_take_without_warm_marks(workers: list, sizes: list) -> None:
    """The warm marks never change which hosts (and how many on each) a gang of 2+ takes."""
    free = _free(workers)
    warm, cold = Pools(free), Pools([w._replace(warm=False) for w in free])
    for n in [s + 1 for s in sizes]:
        got, want = warm.take_gang(n), cold.take_gang(n)
        hosts = [Counter(w.host for w in ws) if ws else None for ws in (got, want)]
        assert hosts[0] == hosts[1]
        if got is not None:  # a warm one only once the host's cold ones are all taken
            left = warm.hosts[kind_of(got[0].device, got[0].device_name)]
            for h in {w.host for w in got if w.warm}:
                assert all(w.warm for w in left.get(h, []))


@settings(max_examples=200, deadline=None)
@given(workers=workers_st)
def test_a_one_rank_job_is_warm_whenever_its_kind_has_a_warm_idle_worker(workers: list) -> None:
    free = _free(workers)
    got = Pools(free).take_gang(1)
    want = Pools([w._replace(warm=False) for w in free]).take_gang(1)
    if got is None or want is None:
        assert got == want
        return
    (w,) = got
    kind = kind_of(w.device, w.device_name)
    assert kind == kind_of(want[0].device, want[0].device_name)  # the kind, as before
    assert w.warm == any(x.warm for x in free if kind_of(x.device, x.device_name) == kind)


@settings(max_examples=200, deadline=None)
@given(
    workers=workers_st,
    jobs=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 600)), max_size=16),
    max_ranks=st.integers(1, 6),
)
def test_bounded_passes_place_what_one_pass_places_with_warm_marks(
    workers: list, jobs: list, max_ranks: int
) -> None:
    free = _free(workers)
    live = _live(free)  # the registered workers: the same for every pass
    queued = [_job(f"j{i:02d}", n, age) for i, (n, age) in enumerate(jobs)]
    whole = _placed(queued, free)
    got: list = []
    for _ in range(len(queued) + 1):
        p = plan(queued, free, live, now=NOW, max_ranks=max_ranks)
        got += [(j.id, [w.id for w in ws]) for j, ws in p.gangs]
        taken = {w.id for _, ws in p.gangs for w in ws}
        free = [w for w in free if w.id not in taken]
        queued = [j for j in queued if j.id not in {j.id for j, _ in p.gangs}]
        if not p.truncated:
            break
    assert got == whole


def test_a_pass_reads_the_warm_mark_and_places_on_the_warm_worker(db_url: str) -> None:
    with session_scope(db_url) as s:
        make_worker(s, "w0")
        make_worker(s, "w1")
        s.execute(update(Worker).where(Worker.id == "w1").values(warm_since=utcnow()))
        job = make_job(s)
    with session_scope(db_url) as s:
        free = idle_workers(s, utcnow() - timedelta(seconds=10))
        assert [(w.id, w.warm) for w in free] == [("w0", False), ("w1", True)]
        (d,) = schedule(s, heartbeat_timeout_s=10)
    assert (d.job_id, d.worker_id) == (job.id, "w1")
