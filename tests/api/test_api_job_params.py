"""A job's `params` through HTTP, on each database backend: kept in its spec as given, read
back for the dashboard's table (a JSON member of the stored spec), and
`GET /v1/jobs?param=name:value` matching the stored JSON value in SQL (a JSON member read
per dialect, every part a bound parameter), alone and together, within what the caller may
see; bad params and bad filters are a 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.backends import only
from support.db import SPEC

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

Headers = dict[str, str]


def _submit(client: TestClient, who: Headers, name: str, params: dict[str, Any]) -> str:
    r = client.post("/v1/jobs", json=SPEC | {"name": name, "params": params}, headers=who)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["params"] == params
    return str(r.json()["id"])


def _names(client: TestClient, who: Headers, *filters: str) -> set[str]:
    r = client.get("/v1/jobs", params=[("param", f) for f in filters], headers=who)
    assert r.status_code == 200, r.text
    return {j["name"] for j in r.json()["items"]}


def test_list_filters_by_a_params_json_value(
    client: TestClient, alice: Headers, bob: Headers
) -> None:
    _submit(client, alice, "a", {"lr": 0.1, "arch": "wide", "n": 3, "tiny": 1e-05, "on": True})
    _submit(client, alice, "b", {"lr": 0.01, "arch": "narrow", "n": 3.0, "label": "3"})
    _submit(client, alice, "c", {"lr": 0.1, "arch": "narrow"})
    _submit(client, bob, "d", {"lr": 0.1})
    client.post("/v1/jobs", json=SPEC | {"name": "none"}, headers=alice)
    assert _names(client, alice, "lr:0.1") == {"a", "c"}  # bob's is not alice's to see
    assert _names(client, bob, "lr:0.1") == {"d"}
    assert _names(client, alice, "lr:0.10") == {"a", "c"}  # the same number
    assert _names(client, alice, "lr:0.1", "arch:narrow") == {"c"}  # all must match
    assert _names(client, alice, "arch:wide") == {"a"}
    assert _names(client, alice, "n:3") == {"a", "b"}  # 3 and 3.0
    assert _names(client, alice, "tiny:0.00001") == {"a"}
    assert _names(client, alice, "on:true") == {"a"}
    assert _names(client, alice, "label:3") == {"b"}  # the string "3" too
    assert _names(client, alice, 'label:"3"') == {"b"}
    assert _names(client, alice, 'n:"3"') == set()  # a quoted value is a string
    assert _names(client, alice, "missing:1") == set()
    # A value is a bound parameter, never SQL text.
    assert _names(client, alice, "arch:wide' OR '1'='1") == set()
    assert _names(client, alice, "arch:") == set()


@only("sqlite")  # validation, before any SQL
@pytest.mark.parametrize(
    ("given", "why"),
    [
        (["lr"], "must be name:value"),
        (["l r:1"], "must be name:value"),
        (["lr') OR 1=1 --:1"], "must be name:value"),
        (["params.lr:1"], "must be name:value"),
        ([f"p{i}:1" for i in range(9)], "at most 8 filters"),
        (["lr:" + "x" * 1025], "at most 1024 characters"),
    ],
)
def test_a_bad_filter_is_422_naming_param(
    client: TestClient, alice: Headers, given: list[str], why: str
) -> None:
    r = client.get("/v1/jobs", params=[("param", g) for g in given], headers=alice)
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["details"]
    assert problem["field"] == "param" and why in problem["message"]


@only("sqlite")
def test_bad_params_are_422_naming_each(client: TestClient, alice: Headers) -> None:
    params = {"ok": 1, "bad name": 1, "nested": {"a": 1}, "none": None, "long": "x" * 1025}
    r = client.post("/v1/jobs", json=SPEC | {"params": params}, headers=alice)
    assert r.status_code == 422, r.text
    fields = {p["field"] for p in r.json()["error"]["details"]}
    assert fields == {"params.bad name", "params.nested", "params.none", "params.long"}
    many = {f"p{i}": i for i in range(65)}
    r = client.post("/v1/jobs", json=SPEC | {"params": many}, headers=alice)
    assert r.status_code == 422
    [problem] = r.json()["error"]["details"]
    assert problem["field"] == "params" and "at most 64" in problem["message"]


@only("sqlite")
def test_a_spec_without_params_stores_none(client: TestClient, alice: Headers) -> None:
    r = client.post("/v1/jobs", json=SPEC, headers=alice)
    assert r.status_code == 201 and "params" not in r.json()["spec"]


def test_the_dashboards_table_rows_carry_params(client: TestClient, alice: Headers) -> None:
    _submit(client, alice, "a", {"lr": 0.1, "arch": "wide", "on": False})
    client.post("/v1/jobs", json=SPEC | {"name": "none"}, headers=alice)
    rows = client.get("/v1/ui/jobs", headers=alice).json()["items"]
    assert {r["name"]: r["params"] for r in rows} == {
        "a": {"lr": 0.1, "arch": "wide", "on": False},
        "none": {},
    }
