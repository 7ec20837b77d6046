"""The metrics route's step range (`min_step`, `max_step`): what a chart's zoom loads.

Downsampled answers are checked against the raw points themselves: each bucket's
`min`/`max` must be those of every point between the previous bucket's last step and its
own, so no spike inside the range can be lost, whichever rollup blocks served it."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

N = 50_000
SPIKES = {123: 400.0, 10_007: 250.0, 17_001: -90.0, 40_960: 777.0, 49_999: 3.5}


def _values() -> dict[int, float]:
    rng = random.Random(7)
    vals = {k: rng.uniform(0.5, 1.5) for k in range(N)}
    vals.update(SPIKES)
    return vals


@pytest.fixture
def big_job(factory: Factory, db_url: str) -> tuple[str, dict[int, float]]:
    job = factory.job("alice", state="running")
    vals = _values()
    rows = [{"name": "loss", "step": k, "epoch": None, "value": v, "time": 1.0} for k, v in vals.items()]  # fmt: skip
    with session_scope(db_url) as s:
        for i in range(0, N, 10_000):  # batches as a worker sends them: blocks merged
            ingest_metrics(s, job, rows[i : i + 10_000])
    return job, vals


def _get(client: TestClient, job: str, headers: dict[str, str], **params: Any) -> Any:
    r = client.get(f"/v1/jobs/{job}/metrics", params={"name": "loss", **params}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["series"]["loss"]


def _check_buckets(s: dict[str, list[Any]], vals: dict[int, float], lo: int, hi: int) -> None:
    """Every bucket's min, max and last value against the raw points it covers."""
    inside = sorted(k for k in vals if lo <= k <= hi)
    assert s["steps"] and s["steps"][-1] == inside[-1]
    assert all(lo <= k <= hi for k in s["steps"])
    prev = lo - 1
    for step, value, vmin, vmax in zip(s["steps"], s["values"], s["min"], s["max"], strict=True):
        covered = [vals[k] for k in inside if prev < k <= step]
        assert covered, f"bucket ending at {step} covers no point"
        assert (vmin, vmax) == (min(covered), max(covered)), f"bucket ending at {step}"
        assert value == vals[step]
        prev = step
    assert sum(1 for k in inside if k > prev) == 0  # nothing after the last bucket


@pytest.mark.parametrize(
    ("lo", "hi", "max_points"),
    [
        (10_000, 15_000, 100),  # points only (width 51)
        (10_001, 17_000, 40),  # 64-step blocks, both ends cut mid-block
        (0, 49_999, 5),  # 4096-step blocks over everything
        (4_000, 45_000, 3),  # 4096-step blocks, cut ends from points
        (17_001, 17_001, 10),  # one step
    ],
)
def test_downsampled_range_keeps_every_extreme(
    client: TestClient,
    alice: dict[str, str],
    big_job: tuple[str, dict[int, float]],
    lo: int,
    hi: int,
    max_points: int,
) -> None:
    job, vals = big_job
    s = _get(client, job, alice, min_step=lo, max_step=hi, max_points=max_points)
    assert len(s["steps"]) <= max_points
    _check_buckets(s, vals, lo, hi)
    inside = [v for k, v in vals.items() if lo <= k <= hi]  # the spikes, as a chart shows
    assert (min(s["min"]), max(s["max"])) == (min(inside), max(inside))


def test_range_without_upper_bound_matches_the_whole_curve(
    client: TestClient, alice: dict[str, str], big_job: tuple[str, dict[int, float]]
) -> None:
    job, vals = big_job
    s = _get(client, job, alice, min_step=30_000, max_points=7)
    _check_buckets(s, vals, 30_000, N - 1)
    whole = _get(client, job, alice, max_points=7)
    _check_buckets(whole, vals, 0, N - 1)


def test_raw_range_pages_within_bounds(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str
) -> None:
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(s, job, [{"name": "loss", "step": k, "value": float(k), "time": 1.0} for k in range(0, 100, 2)])  # fmt: skip
    s = _get(client, job, alice, min_step=10, max_step=20)
    assert s == {"steps": [10, 12, 14, 16, 18, 20], "values": [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]}
    # after_step narrows the range further (following a zoomed, live chart)
    assert _get(client, job, alice, min_step=10, max_step=20, after_step=15)["steps"] == [
        16,
        18,
        20,
    ]
    assert _get(client, job, alice, min_step=11, max_step=11)["steps"] == []
    ds = _get(client, job, alice, min_step=10, max_step=20, max_points=2)
    assert ds["steps"][-1] == 20 and min(ds["min"]) == 10.0 and max(ds["max"]) == 20.0


def test_raw_range_pages(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str, app: Any
) -> None:
    app.state.settings = app.state.settings.model_copy(update={"metrics_page_points": 4})
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(s, job, [{"name": "loss", "step": k, "value": 1.0, "time": 1.0} for k in range(30)])  # fmt: skip
    url, seen, after = f"/v1/jobs/{job}/metrics", [], None
    for _ in range(10):
        params: dict[str, Any] = {"min_step": 5, "max_step": 14}
        if after is not None:
            params["after_step"] = after
        body = client.get(url, params=params, headers=alice).json()
        seen += body["series"]["loss"]["steps"]
        after = body.get("next_after_step")
        if after is None:
            break
    assert seen == list(range(5, 15))


def test_pages_are_bounded_across_series_and_a_long_one_gets_what_short_ones_left(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str, app: Any
) -> None:
    """TORCHYARD_METRICS_PAGE_TOTAL_POINTS over all curves: 9 curves of 10 points leave a
    long one most of a 1,000-point page (an even share would be 100), pages follow as
    before, and downsampled curves get fewer buckets each."""
    app.state.settings = app.state.settings.model_copy(update={"metrics_page_total_points": 1000})
    job = factory.job("alice", state="running")
    rows = [{"name": "long", "step": k, "value": 1.0, "time": 1.0} for k in range(2500)]
    rows += [{"name": f"short{i}", "step": k, "value": 1.0, "time": 1.0}
             for i in range(9) for k in range(10)]  # fmt: skip
    with session_scope(db_url) as s:
        ingest_metrics(s, job, rows)
    url, after, pages = f"/v1/jobs/{job}/metrics", None, []
    while True:
        params = {} if after is None else {"after_step": after}
        body = client.get(url, params=params, headers=alice).json()
        pages.append(body)
        assert sum(len(c["steps"]) for c in body["series"].values()) <= 1000
        after = body.get("next_after_step")
        if after is None:
            break
    assert len(pages[0]["series"]["long"]["steps"]) == 910 and pages[0]["capped"] is True
    assert [k for b in pages for k in b["series"]["long"]["steps"]] == list(range(2500))
    assert [k for b in pages for k in b["series"]["short3"]["steps"]] == list(range(10))
    assert "capped" not in pages[-1] and len(pages) == 3
    wide = client.get(url, params={"max_points": 500}, headers=alice).json()
    assert len(wide["series"]["long"]["steps"]) <= 100 and wide["capped"] is True
    assert "capped" not in client.get(url, params={"max_points": 50}, headers=alice).json()


def test_range_validation_etag_and_access(
    client: TestClient,
    alice: dict[str, str],
    bob: dict[str, str],
    factory: Factory,
    db_url: str,
) -> None:
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(s, job, [{"name": "loss", "step": k, "value": 1.0, "time": 1.0} for k in range(10)])  # fmt: skip
    url = f"/v1/jobs/{job}/metrics"
    bad = client.get(url, params={"min_step": 5, "max_step": 4}, headers=alice)
    assert bad.status_code == 422
    assert bad.json()["error"]["details"][0]["field"] == "max_step"
    assert client.get(url, params={"min_step": "x"}, headers=alice).status_code == 422
    a = client.get(url, params={"min_step": 1, "max_step": 5}, headers=alice)
    b = client.get(url, params={"min_step": 1, "max_step": 6}, headers=alice)
    assert a.headers["ETag"] != b.headers["ETag"]
    again = client.get(
        url,
        params={"min_step": 1, "max_step": 5},
        headers={**alice, "If-None-Match": a.headers["ETag"]},
    )
    assert again.status_code == 304
    assert client.get(url, params={"min_step": 1}, headers=bob).status_code == 404
