"""Metric ingest (idempotent; rollups equal to a computation from scratch), queries
(downsampling checked point by point against a plain computation) and the event feed's
cursor."""

from __future__ import annotations

import bisect
import random

import pytest
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session
from support.db import Factory

from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.feed import BadFeedCursor, FeedCursor, poll
from torchyard.store.jobs import Viewer, job_snapshot
from torchyard.store.metrics import (
    BLOCK_LEVELS,
    ingest_metrics,
    metric_names,
    query_series,
    rebuild_blocks,
)
from torchyard.store.models import Metric, MetricBlock

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


def _check_buckets(points: dict[int, float], after: int, max_points: int, series: dict) -> None:
    """Every input point lies in exactly one bucket (between two returned steps), and each
    bucket reports that range's last value, min and max."""
    steps = sorted(s for s in points if s > after)
    if not steps:
        assert series == {"steps": [], "values": [], "min": [], "max": []}
        return
    assert series["steps"][-1] == steps[-1]
    assert len(series["steps"]) <= max_points
    start = 0
    for step, value, lo, hi in zip(
        series["steps"], series["values"], series["min"], series["max"], strict=True
    ):
        end = bisect.bisect_right(steps, step)
        inside = [points[s] for s in steps[start:end]]
        assert inside, step
        assert value == points[step] and lo == min(inside) and hi == max(inside)
        start = end
    assert start == len(steps)


@pytest.mark.parametrize("case", ["dense", "sparse", "replayed"])
def test_downsampling_keeps_last_min_and_max(session: Session, factory: Factory, case: str) -> None:
    job = factory.job("alice", state="running")
    rnd = random.Random(case)
    if case == "dense":
        steps = range(12_000)
    elif case == "sparse":
        steps = range(0, 150_000, 7)
    else:
        steps = range(5_000, 25_000)
    points = {s: rnd.random() for s in steps}
    rows = [{"name": "train/loss", "step": s, "value": v, "time": 0.0} for s, v in points.items()]
    for i in range(0, len(rows), 3000):
        ingest_metrics(session, job, rows[i : i + 3000])
    if case == "replayed":  # a resumed attempt rewrites some steps: rollups must follow
        for s in range(9_000, 12_000):
            points[s] = rnd.random() * 10
        ingest_metrics(
            session, job,
            [{"name": "train/loss", "step": s, "value": points[s], "time": 1.0} for s in range(9_000, 12_000)],
        )  # fmt: skip
    session.commit()
    for max_points, after in (
        (1000, -1),
        (37, -1),
        (500, 12_345),
        (50, 11_990),
        (3, 100),
        (10_000, -1),
    ):
        series = query_series(
            session, job, names=["train/loss"], max_points=max_points, after_step=after
        )
        _check_buckets(points, after, max_points, series["train/loss"])
    last3 = sorted(points)[-3:]
    raw = query_series(session, job, names=["train/loss"], after_step=last3[0] - 1)["train/loss"]
    assert raw == {"steps": last3, "values": [points[s] for s in last3]}


def test_names_and_latest(session: Session, factory: Factory) -> None:
    job = factory.job("alice", state="running")

    def latest_metrics(session: Session, job: str) -> dict:
        snap = job_snapshot(session, Viewer(user_id=0, is_admin=True), job)
        assert snap is not None
        return snap["latest_metrics"]

    assert latest_metrics(session, job) == {} and metric_names(session, job) == []
    ingest_metrics(
        session, job,
        [{"name": n, "step": s, "value": float(s), "time": 0.0} for n in ("b", "a", "c") for s in range(5)],
    )  # fmt: skip
    ingest_metrics(session, job, [{"name": "a", "step": 4, "value": -1.0, "time": 0.0}])  # replay
    assert metric_names(session, job) == ["a", "b", "c"]
    assert latest_metrics(session, job) == {
        "a": {"step": 4, "value": -1.0},
        "b": {"step": 4, "value": 4.0},
        "c": {"step": 4, "value": 4.0},
    }


def test_feed_cursor_resumes_exactly(session: Session, factory: Factory) -> None:
    job = factory.job("alice", state="running")
    ingest_metrics(
        session, job, [{"name": "l", "step": s, "value": 1.0, "time": 0.0} for s in range(3)]
    )
    record_checkpoint(
        session,
        job,
        attempt=1,
        step=2,
        epoch=None,
        path="checkpoints/a.pt",
        bytes=1,
        sha256="0" * 64,
    )
    session.commit()
    page = poll(session, job, FeedCursor())
    assert [i.type for i in page.items] == ["metric"] * 3 + ["checkpoint"] + ["state"] * 3
    assert not page.finished
    middle = page.items[3].cursor
    rest = poll(session, job, FeedCursor.parse(middle.encode()))
    assert [i.cursor for i in rest.items] == [i.cursor for i in page.items[4:]]
    # a replayed metric (same step) is not sent again; a new one is
    ingest_metrics(session, job, [{"name": "l", "step": 2, "value": 5.0, "time": 0.0}])
    ingest_metrics(session, job, [{"name": "l", "step": 3, "value": 5.0, "time": 0.0}])
    session.commit()  # SQLite: one writer at a time
    factory.set_state(job, "succeeded")
    tail = poll(session, job, page.cursor)
    assert [(i.type, i.data.get("step"), i.data.get("state")) for i in tail.items] == [
        ("metric", 3, None),
        ("state", None, "succeeded"),
    ]
    assert poll(session, job, tail.cursor).finished
    with pytest.raises(BadFeedCursor):
        FeedCursor.parse("1-2")


def _table(session: Session, job: str) -> tuple[list[tuple], list[tuple]]:
    points = session.execute(
        select(Metric.id, Metric.name, Metric.step, Metric.epoch, Metric.value, Metric.time)
        .where(Metric.job_id == job)
        .order_by(Metric.id)
    ).all()
    blocks = session.execute(
        select(MetricBlock.name, MetricBlock.level, MetricBlock.block, MetricBlock.vmin,
               MetricBlock.vmax, MetricBlock.last_step, MetricBlock.n)
        .where(MetricBlock.job_id == job)
        .order_by(MetricBlock.name, MetricBlock.level, MetricBlock.block)
    ).all()  # fmt: skip
    return [tuple(p) for p in points], [tuple(b) for b in blocks]


def _blocks_from_scratch(points: list[tuple]) -> list[tuple]:
    """Every rollup block computed from the points alone (steps from 0)."""
    agg: dict[tuple[str, int, int], list] = {}
    for _id, name, step, _epoch, value, _time in points:
        for level in BLOCK_LEVELS:
            if step < 0:
                continue
            a = agg.setdefault((name, level, step // level), [value, value, step, 0])
            a[0], a[1], a[2], a[3] = min(a[0], value), max(a[1], value), max(a[2], step), a[3] + 1
    return sorted((*k, *v) for k, v in agg.items())


def test_ingest_is_idempotent_and_rollups_equal_a_computation_from_scratch(
    session: Session, factory: Factory
) -> None:
    job = factory.job("alice", state="running")
    rnd = random.Random(7)

    def batch(steps: range | list[int], scale: float = 1.0) -> list[dict]:
        return [
            {"name": n, "step": s, "epoch": s // 100, "value": rnd.random() * scale,
             "time": 1.7e9 + s}
            for s in steps
            for n in ("train/loss", "val/loss")
        ]  # fmt: skip

    first = batch(range(0, 5000, 3))  # new points
    sent = [
        first,
        batch(range(5000, 9000)),  # new points, blocks continued from the last batch
        batch(range(100, 4200, 7), scale=10) + batch(range(9000, 9100)),  # replay + new
        batch([-5, -1, 2, 4, 8800, 9100]) + batch([9100], scale=-1),  # gaps, negatives, dup
    ]
    for rows in sent:
        ingest_metrics(session, job, rows)
        session.commit()
        points, blocks = _table(session, job)
        assert blocks == _blocks_from_scratch(points)
        # The same batch sent again (a crash after its commit, before the worker knew):
        # nothing new, and no value, id or rollup changes.
        ingest_metrics(session, job, rows)
        session.commit()
        assert _table(session, job) == (points, blocks)
    # The last row of a (name, step) in a batch wins; every (name, step) is one row.
    latest: dict[tuple[str, int], float] = {}
    for rows in sent:
        latest.update({(r["name"], r["step"]): r["value"] for r in rows})
    assert {(p[1], p[2]): p[4] for p in points} == latest and len(points) == len(latest)
    # Rollups lost or damaged (a bulk load that bypassed ingest, a repair): rebuilt from
    # the points alone, the same as ingest left them.
    session.execute(delete(MetricBlock).where(MetricBlock.job_id == job, MetricBlock.level > 100))
    session.execute(update(MetricBlock).where(MetricBlock.job_id == job).values(vmax=-1.0))
    rebuild_blocks(session, job)
    session.commit()
    assert _table(session, job) == (points, blocks)


def test_points_are_stored_exactly_as_sent(session: Session, factory: Factory) -> None:
    """The batch travels as binary arrays on PostgreSQL: every number comes back bit for bit
    (steps past 2**31 and below 0, epochs missing in some rows or in all, floats that a
    short decimal cannot hold), in the order sent (ids)."""
    job = factory.job("alice", state="running")
    rows = [
        {"name": "a", "step": 2**40 + k, "epoch": None if k % 2 else k / 3, "value": 0.1 + k / 7,
         "time": 1.7e9 + k / 9}
        for k in range(5)
    ] + [
        {"name": "b", "step": -3, "value": -1e-300, "time": 0.0},
        {"name": "b", "step": 0, "value": 1e300, "time": 0.0},
        {"name": "b", "step": 0, "value": 2.5, "time": 1.0},  # the last of a key wins
    ]  # fmt: skip
    ingest_metrics(session, job, rows)
    session.commit()
    got = session.execute(
        select(Metric.name, Metric.step, Metric.epoch, Metric.value, Metric.time)
        .where(Metric.job_id == job)
        .order_by(Metric.id)
    ).all()
    want = [(r["name"], r["step"], r.get("epoch"), r["value"], r["time"]) for r in rows]
    assert [tuple(g) for g in got] == want[:6] + want[7:]
    blocks = session.execute(
        select(MetricBlock.name, MetricBlock.level, MetricBlock.vmin, MetricBlock.n)
        .where(MetricBlock.job_id == job, MetricBlock.name == "b")
        .order_by(MetricBlock.level)
    ).all()
    assert [tuple(b) for b in blocks] == [("b", 64, 2.5, 1), ("b", 4096, 2.5, 1)]
