"""`GET /v1/jobs/{id}/metrics?format=csv` (every point, streamed, as an attachment) and
`times=true` on the JSON pages (what the TensorBoard export reads)."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

import torchyard.api.metricscsv as metricscsv
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics


@pytest.fixture
def job(factory: Factory, db_url: str) -> str:
    job = factory.job("alice", state="running")
    rows = [{"name": "train/loss", "step": k, "epoch": k / 100, "value": 1 / (k + 3), "time": 1.7e9 + k / 7}
            for k in range(250)]  # fmt: skip
    rows += [{"name": "val/acc", "step": k, "epoch": None, "value": k / 3, "time": 1.7e9 + k}
             for k in range(0, 250, 50)]  # fmt: skip
    rows.append({"name": "weird", "step": -3, "epoch": 0.0, "value": math.inf, "time": 5.0})
    with session_scope(db_url) as s:
        ingest_metrics(s, job, rows)
    return job


def _csv(client: TestClient, job: str, h: dict[str, str], **params: Any) -> list[list[str]]:
    r = client.get(f"/v1/jobs/{job}/metrics", params={"format": "csv", **params}, headers=h)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/csv; charset=utf-8"
    assert r.headers["content-disposition"] == f'attachment; filename="{job}-metrics.csv"'
    return list(csv.reader(io.StringIO(r.text)))


def test_every_point_one_row_paged_through_the_store(
    client: TestClient, alice: dict[str, str], job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metricscsv, "PAGE_ROWS", 7)  # the store is read in many pages
    rows = _csv(client, job, alice)
    assert rows[0] == ["name", "step", "epoch", "value", "time"]
    body = rows[1:]
    assert len(body) == 250 + 5 + 1
    loss = [r for r in body if r[0] == "train/loss"]
    assert [int(r[1]) for r in loss] == list(range(250))
    for r in loss:
        k = int(r[1])
        assert float(r[2]) == k / 100 and float(r[3]) == 1 / (k + 3)  # exact: repr round-trips
        assert float(r[4]) == 1.7e9 + k / 7
    acc = [r for r in body if r[0] == "val/acc"]
    assert [r[1] for r in acc] == ["0", "50", "100", "150", "200"] and acc[0][2] == ""
    assert ["weird", "-3", "0.0", "inf", "5.0"] in body
    assert [r[0] for r in body] == sorted(r[0] for r in body)  # by name, then step


def test_the_selection_parameters_apply(
    client: TestClient, alice: dict[str, str], job: str
) -> None:
    rows = _csv(client, job, alice, name="train/loss", min_step=10, max_step=20)[1:]
    assert [int(r[1]) for r in rows] == list(range(10, 21))
    rows = _csv(client, job, alice, name="train/loss,val/acc", after_step=200)[1:]
    assert [(r[0], int(r[1])) for r in rows] == [("train/loss", k) for k in range(201, 250)]
    assert _csv(client, job, alice, name="nothing") == [["name", "step", "epoch", "value", "time"]]


def test_json_stays_the_default_and_times_come_on_request(
    client: TestClient, alice: dict[str, str], job: str, app: Any
) -> None:
    app.state.settings = app.state.settings.model_copy(update={"metrics_page_points": 100})
    url = f"/v1/jobs/{job}/metrics"
    plain = client.get(url, params={"name": "train/loss"}, headers=alice).json()
    assert "times" not in plain["series"]["train/loss"] and plain["next_after_step"] == 99
    timed = client.get(url, params={"name": "train/loss", "times": "true"}, headers=alice)
    first = timed.json()["series"]["train/loss"]
    assert first["times"] == [1.7e9 + k / 7 for k in range(100)]
    params = {"name": "train/loss", "times": True, "after_step": 99}
    after = client.get(url, params=params, headers=alice).json()["series"]["train/loss"]
    assert len(after["times"]) == len(after["steps"]) == 100 and after["steps"][0] == 100
    # the three shapes are three ETags
    tags = {client.get(url, params=p, headers=alice).headers["etag"]
            for p in ({}, {"times": True}, {"format": "csv"})}  # fmt: skip
    assert len(tags) == 3


def test_csv_not_modified_and_refusals(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], job: str
) -> None:
    url = f"/v1/jobs/{job}/metrics"
    tag = client.get(url, params={"format": "csv"}, headers=alice).headers["etag"]
    again = client.get(url, params={"format": "csv"}, headers={**alice, "If-None-Match": tag})
    assert again.status_code == 304 and again.content == b""
    for params, field in (
        ({"format": "xml"}, "format"),
        ({"format": "csv", "max_points": 10}, "max_points"),
        ({"format": "csv", "min_step": 5, "max_step": 1}, "max_step"),
    ):
        r = client.get(url, params=params, headers=alice)
        assert r.status_code == 422, params
        assert [d["field"] for d in r.json()["error"]["details"]] == [field]
    assert client.get(url, params={"format": "csv"}, headers=bob).status_code == 404
    assert client.get(url, params={"format": "csv"}).status_code == 401
