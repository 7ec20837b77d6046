"""Metric queries (downsampling checked point by point against a plain computation) and
the event feed's cursor."""

from __future__ import annotations

import bisect
import random

import pytest
from sqlalchemy.orm import Session
from torchyard_testdb import Factory

from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.feed import BadFeedCursor, FeedCursor, poll
from torchyard.store.metrics import ingest_metrics, latest_metrics, metric_names, query_series


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
