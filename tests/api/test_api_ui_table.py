"""The dashboard's jobs table as a runs table, on each database backend: the metric columns
asked for (`metric`, their latest values), the order by a metric's latest value, a param
(numbers by value, then the others) or age (`sort`, nulls last, paged in SQL), and filters
on a metric's latest value (`filter`), every name and number a bound parameter; bad ones a
422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.backends import only
from support.db import SPEC, Factory

from torchyard.api.routers.ui_jobs import METRIC_NAME_RE
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

Headers = dict[str, str]
# name: (params, {metric: [values by step]}); created in this order (newest last)
JOBS: dict[str, tuple[dict[str, Any] | None, dict[str, list[float]]]] = {
    "a": ({"lr": 0.1, "arch": "wide"}, {"val/accuracy": [0.5, 0.95], "train/loss": [0.3], "val/f1": [0.5]}),
    "b": ({"lr": 2, "arch": "narrow"}, {"val/accuracy": [0.9, 0.7], "train/loss": [0.5]}),
    "c": ({"lr": 10}, {}),
    "d": ({"lr": "auto"}, {"val/accuracy": [0.9]}),
    "e": (None, {"val/accuracy": [0.8]}),
}  # fmt: skip


@pytest.fixture
def jobs(factory: Factory, db_url: str) -> dict[str, str]:
    ids = {}
    for name, (params, metrics) in JOBS.items():
        spec = SPEC | {"name": name} | ({"params": params} if params else {})
        ids[name] = factory.job("alice", state="succeeded", spec=spec)
        with session_scope(db_url) as s:
            for metric, values in metrics.items():
                rows = [{"name": metric, "step": k, "value": v, "time": 1.0} for k, v in enumerate(values)]  # fmt: skip
                ingest_metrics(s, ids[name], rows)
    other = factory.job("bob", state="succeeded", spec=SPEC | {"name": "bobs"})
    with session_scope(db_url) as s:
        ingest_metrics(s, other, [{"name": "val/accuracy", "step": 0, "value": 0.99, "time": 1.0}])
    return ids


def _get(client: TestClient, who: Headers, **params: Any) -> Any:
    r = client.get("/v1/ui/jobs", params=params, headers=who)
    assert r.status_code == 200, r.text
    return r.json()


def _names(client: TestClient, who: Headers, **params: Any) -> list[str]:
    return [j["name"] for j in _get(client, who, **params)["items"]]


def test_metric_columns_are_the_latest_values_asked_for(
    client: TestClient, alice: Headers, jobs: dict[str, str]
) -> None:
    body = _get(client, alice)
    latest = {j["name"]: j["latest"] for j in body["items"]}
    assert latest["a"] == {"train/loss": 0.3, "val/accuracy": 0.95}  # the default two
    assert body["metric_names"] == ["train/loss", "val/accuracy", "val/f1"]  # to choose from
    chosen = _get(client, alice, metric=["val/f1,val/accuracy"])
    latest = {j["name"]: j["latest"] for j in chosen["items"]}
    assert latest["a"] == {"val/f1": 0.5, "val/accuracy": 0.95}
    assert latest["b"] == {"val/accuracy": 0.7} and latest["c"] == {}
    repeated = _get(client, alice, metric=["val/f1", "val/accuracy"])
    assert repeated["items"] == chosen["items"]
    assert all(j["latest"] == {} for j in _get(client, alice, metric="")["items"])


def test_sorted_by_a_metric_nulls_last_and_paged_in_that_order(
    client: TestClient, alice: Headers, jobs: dict[str, str]
) -> None:
    assert _names(client, alice) == ["e", "d", "c", "b", "a"]  # newest first
    desc = {"sort": "metric:val/accuracy:desc"}
    assert _names(client, alice, **desc) == ["a", "d", "e", "b", "c"]  # b's latest is 0.7
    assert _names(client, alice, sort="metric:val/accuracy") == ["a", "d", "e", "b", "c"]
    assert _names(client, alice, sort="metric:val/accuracy:asc") == ["b", "e", "d", "a", "c"]
    page = _get(client, alice, **desc, offset=1, limit=2)
    assert [j["name"] for j in page["items"]] == ["d", "e"] and page["total"] == 5
    assert _names(client, alice, sort="metric:train/loss:desc") == ["b", "a", "e", "d", "c"]
    assert _names(client, alice, sort="created_at:asc") == ["a", "b", "c", "d", "e"]
    assert _names(client, alice, sort="created_at") == ["e", "d", "c", "b", "a"]


def test_sorted_by_a_param_numbers_by_value_then_text(
    client: TestClient, alice: Headers, jobs: dict[str, str]
) -> None:
    # 10 after 2 (a number, not its text), the string after the numbers, none last.
    assert _names(client, alice, sort="param:lr:asc") == ["a", "b", "c", "d", "e"]
    assert _names(client, alice, sort="param:lr:desc") == ["c", "b", "a", "d", "e"]
    assert _names(client, alice, sort="param:arch:asc") == ["b", "a", "e", "d", "c"]
    assert _names(client, alice, sort="param:missing:asc") == ["e", "d", "c", "b", "a"]


def test_filtered_by_a_metrics_latest_value(
    client: TestClient, alice: Headers, jobs: dict[str, str]
) -> None:
    body = _get(client, alice, filter="metric:val/accuracy:gt:0.8")
    assert [j["name"] for j in body["items"]] == ["d", "a"]  # not bob's 0.99, not b's 0.9 at step 0
    assert body["total"] == 2 and body["counts"] == {"succeeded": 2}
    assert _names(client, alice, filter="metric:val/accuracy:ge:0.8") == ["e", "d", "a"]
    assert _names(client, alice, filter="metric:val/accuracy:lt:0.8") == ["b"]
    assert _names(client, alice, filter="metric:val/accuracy:le:0.8") == ["e", "b"]
    both = ["metric:val/accuracy:ge:0.8", "metric:train/loss:lt:1e-0"]
    assert _names(client, alice, filter=both) == ["a"]  # all kept; no train/loss: not kept
    assert _names(client, alice, filter="metric:val/accuracy:gt:-.5", sort="metric:val/accuracy:asc") == ["b", "e", "d", "a"]  # fmt: skip
    assert _names(client, alice, filter="metric:nothing:gt:0") == []


def test_names_are_parameters_never_sql(
    client: TestClient, alice: Headers, jobs: dict[str, str]
) -> None:
    # A name the checks let through (SQL comment dashes, a path) only ever matches a metric
    # or param of that very name.
    assert _names(client, alice, filter="metric:val/accuracy--:gt:0") == []
    assert _names(client, alice, filter="metric:../val/accuracy:gt:0") == []
    assert _names(client, alice, sort="metric:val/accuracy--:asc") == ["e", "d", "c", "b", "a"]
    assert _names(client, alice, sort="param:_x:asc") == ["e", "d", "c", "b", "a"]
    latest = {j["name"]: j["latest"] for j in _get(client, alice, metric="val/accuracy--")["items"]}  # fmt: skip
    assert set(map(len, latest.values())) == {0}


def test_the_metric_name_rule_is_job_logs() -> None:
    from torchyard.job import METRIC_NAME

    assert METRIC_NAME_RE.pattern == METRIC_NAME.pattern


@only("sqlite")  # validation, before any SQL
@pytest.mark.parametrize(
    ("params", "field", "why"),
    [
        ({"metric": ",".join(f"m{i}" for i in range(9))}, "metric", "at most 8"),
        ({"metric": "Val/Accuracy"}, "metric", "not a metric name"),
        ({"metric": "a" * 101}, "metric", "not a metric name"),
        ({"metric": "val/accuracy'; drop table jobs"}, "metric", "not a metric name"),
        ({"sort": "name"}, "sort", "must be created_at"),
        ({"sort": "metric:val/accuracy:up"}, "sort", "must be created_at"),
        ({"sort": "metric:"}, "sort", "must be created_at"),
        ({"sort": "param:params.lr:asc"}, "sort", "must be created_at"),
        ({"sort": "param:lr') OR 1=1 --"}, "sort", "must be created_at"),
        ({"sort": "created_at:sideways"}, "sort", "must be created_at"),
        ({"sort": "metric:" + "a" * 200}, "sort", "at most 200 characters"),
        ({"filter": "val/accuracy>0.9"}, "filter", "must be metric:<name>"),
        ({"filter": "metric:val/accuracy:eq:0.9"}, "filter", "must be metric:<name>"),
        ({"filter": "param:lr:gt:0.9"}, "filter", "must be metric:<name>"),
        ({"filter": "metric:val/accuracy:gt:abc"}, "filter", "not a finite number"),
        ({"filter": "metric:val/accuracy:gt:nan"}, "filter", "not a finite number"),
        ({"filter": "metric:val/accuracy:gt:1e999"}, "filter", "not a finite number"),
        ({"filter": "metric:val/accuracy:gt:"}, "filter", "not a finite number"),
        ({"filter": [f"metric:m{i}:gt:0" for i in range(5)]}, "filter", "at most 4"),
    ],
)
def test_bad_columns_sorts_and_filters_are_422_naming_the_field(
    client: TestClient, alice: Headers, params: dict[str, Any], field: str, why: str
) -> None:
    r = client.get("/v1/ui/jobs", params=params, headers=alice)
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["details"]
    assert problem["field"] == field or problem["field"].endswith(field), problem
    assert why in problem["message"], problem
