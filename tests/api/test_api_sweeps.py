"""The sweep routes on both databases: create (201), every problem a 422 naming its field,
the permission to run code (403), another user's sweep a 404, no token a 401, list pages,
cancel (202, idempotent)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

Headers = dict[str, str]

SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "batch_size": 64,
    "epochs": 3,
    "seed": 7,
}
BODY: dict[str, Any] = {
    "name": "lr-search",
    "spec": SPEC,
    "space": {
        "optimizer.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True},
        "batch_size": {"type": "categorical", "choices": [32, 64, 128]},
        "model.hidden": {"type": "categorical", "choices": [[64], [128], [256, 128]]},
    },
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 16,
    "parallel": 2,
    "sampler": "tpe",
    "pruner": "asha",
}


def body(**changes: Any) -> dict[str, Any]:
    b = copy.deepcopy(BODY)
    b.update(changes)
    return b


def problems(r: Any) -> dict[str, str]:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    return {d["field"]: d["message"] for d in err["details"]}


def test_create_answers_201_with_the_sweep(client: TestClient, alice: Headers) -> None:
    r = client.post("/v1/sweeps", json=BODY, headers=alice)
    assert r.status_code == 201, r.text
    s = r.json()
    assert s["id"] and s["name"] == "lr-search" and s["state"] == "running"
    assert s["objective"] == {"metric": "val/accuracy", "mode": "max"}
    assert (s["max_trials"], s["parallel"], s["sampler"], s["pruner"]) == (16, 2, "tpe", "asha")
    assert s["seed"] == 7  # the spec's, as none was given
    assert s["trials"] == [] and s["best"] is None and s["owner"] == "alice"
    assert s["spec"] == SPEC and s["space"]["model.hidden"]["choices"][2] == [256, 128]
    assert client.get(f"/v1/sweeps/{s['id']}", headers=alice).json() == s


def test_bounds_choices_and_paths_are_checked_by_building_specs(
    client: TestClient, alice: Headers
) -> None:
    space = copy.deepcopy(BODY["space"])
    space["optimizer.lr"] = {"type": "float", "low": 0.0, "high": 0.3}
    space["batch_size"]["choices"].append(0)
    space["optimizer.lrr"] = {"type": "float", "low": 0.1, "high": 0.2}
    space["epochs.x"] = {"type": "int", "low": 1, "high": 3}
    space["model.hidden"]["choices"].append("wide")
    got = problems(client.post("/v1/sweeps", json=body(space=space), headers=alice))
    assert got == {
        "space.optimizer.lr.low": "makes an invalid spec: optimizer.lr: must be > 0.0",
        "space.batch_size.choices.3": "makes an invalid spec: batch_size: must be >= 1",
        "space.optimizer.lrr": "optimizer.lrr is not a field of the job spec (did you mean 'lr'?)",
        "space.epochs.x": "epochs is not an object in the spec, so epochs.x cannot be set",
        "space.model.hidden.choices.3": "makes an invalid spec: model.hidden: must be a list, "
        'got "wide" (a string)',
    }


def test_a_space_may_set_params(client: TestClient, alice: Headers) -> None:
    space = {"params.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True},
             "params.arch": {"type": "categorical", "choices": ["wide", "narrow"]}}  # fmt: skip
    r = client.post("/v1/sweeps", json=body(space=space), headers=alice)
    assert r.status_code == 201, r.text
    bad = {"params.depth": {"type": "categorical", "choices": [2, [3]]},
           "params.x.y": {"type": "categorical", "choices": [1]}}  # fmt: skip
    got = problems(client.post("/v1/sweeps", json=body(space=bad), headers=alice))
    assert set(got) == {"space.params.depth.choices.1", "space.params.x.y"}
    assert "params.depth" in got["space.params.depth.choices.1"]
    assert "params.x" in got["space.params.x.y"]  # a value, not an object


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"space": {"optimizer.lr": {"type": "float", "low": 0.3, "high": 0.1}}},
         "space.optimizer.lr.high"),
        ({"space": {"optimizer.lr": {"type": "float", "low": 0, "high": 1, "log": True}}},
         "space.optimizer.lr.low"),
        ({"space": {"epochs": {"type": "int", "low": 1, "high": 4, "step": 2, "log": True}}},
         "space.epochs.step"),
        ({"space": {"epochs": {"type": "int", "low": 1}}}, "space.epochs.high"),
        ({"space": {"epochs": {"type": "between", "low": 1}}}, "space.epochs.type"),
        ({"space": {"x..y": {"type": "int", "low": 1, "high": 2}}}, "space.x..y"),
        ({"space": {"seed": {"type": "categorical", "choices": [1, 1]}}}, "space.seed.choices"),
        ({"space": {}}, "space"),
        ({"objective": {"metric": "val/acc", "mode": "max"}}, "objective.metric"),
        ({"objective": {"metric": "val/loss", "mode": "lowest"}}, "objective.mode"),
        ({"trials": 0}, "trials"),
        ({"parallel": 0}, "parallel"),
        ({"sampler": "cmaes"}, "sampler"),
        ({"pruner": "hyperband"}, "pruner"),
        ({"spec": {**SPEC, "epochs": 0}}, "spec.epochs"),
        ({"spec": {**SPEC, "data": {"name": "mnist"}}}, "spec.data.name"),
        ({"colour": "blue"}, "colour"),
    ],
)  # fmt: skip
def test_each_bad_field_is_named(
    client: TestClient, alice: Headers, change: dict[str, Any], field: str
) -> None:
    assert field in problems(client.post("/v1/sweeps", json=body(**change), headers=alice))


def test_a_body_that_is_not_an_object_is_422(client: TestClient, alice: Headers) -> None:
    r = client.post("/v1/sweeps", content=b"[1, 2", headers=alice)
    assert problems(r).keys() == {"body"}
    assert problems(client.post("/v1/sweeps", json=[1], headers=alice)).keys() == {"body"}


def test_a_value_too_large_for_the_server_is_named(client: TestClient, alice: Headers) -> None:
    space = {"model.hidden": {"type": "categorical", "choices": [[64], [1_000_000, 100_000]]}}
    got = problems(client.post("/v1/sweeps", json=body(space=space), headers=alice))
    assert list(got) == ["space.model.hidden.choices.1"]
    assert "model" in got["space.model.hidden.choices.1"]


def test_grid_needs_categorical_or_int_and_stops_at_its_size(
    client: TestClient, alice: Headers
) -> None:
    got = problems(client.post("/v1/sweeps", json=body(sampler="grid"), headers=alice))
    assert got == {"space.optimizer.lr": "sampler grid needs categorical or int parameters"}
    space = {
        "batch_size": {"type": "categorical", "choices": [32, 64]},
        "epochs": {"type": "int", "low": 1, "high": 5, "step": 2},
    }
    r = client.post("/v1/sweeps", json=body(sampler="grid", space=space), headers=alice)
    assert r.status_code == 201, r.text
    assert r.json()["max_trials"] == 6  # 2 x 3 points, though 16 were asked for


def test_values_that_run_code_need_the_permission(client: TestClient, alice: Headers) -> None:
    space = {"data.name": {"type": "categorical", "choices": ["digits", "mydata:build"]}}
    r = client.post("/v1/sweeps", json=body(space=space), headers=alice)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden"


def test_only_the_owner_and_admins_see_a_sweep(
    client: TestClient, alice: Headers, bob: Headers, admin: Headers
) -> None:
    sid = client.post("/v1/sweeps", json=BODY, headers=alice).json()["id"]
    for method, path in (("GET", f"/v1/sweeps/{sid}"), ("POST", f"/v1/sweeps/{sid}/cancel")):
        r = client.request(method, path, headers=bob)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/sweeps", headers=bob).json()["items"] == []
    assert client.get(f"/v1/sweeps/{sid}", headers=admin).status_code == 200
    assert [s["id"] for s in client.get("/v1/sweeps", headers=admin).json()["items"]] == [sid]
    assert client.get("/v1/sweeps/" + "f" * 100, headers=alice).status_code == 404


def test_every_route_needs_a_token(client: TestClient, alice: Headers) -> None:
    sid = client.post("/v1/sweeps", json=BODY, headers=alice).json()["id"]
    for method, path in (
        ("POST", "/v1/sweeps"), ("GET", "/v1/sweeps"), ("GET", f"/v1/sweeps/{sid}"),
        ("POST", f"/v1/sweeps/{sid}/cancel"),
    ):  # fmt: skip
        r = client.request(method, path, json=BODY)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_list_pages_newest_first_and_filters_by_state(client: TestClient, alice: Headers) -> None:
    ids = [client.post("/v1/sweeps", json=body(name=f"s{i}"), headers=alice).json()["id"]
           for i in range(3)]  # fmt: skip
    first = client.get("/v1/sweeps", params={"limit": 2}, headers=alice).json()
    assert [s["id"] for s in first["items"]] == ids[:0:-1] and first["next_cursor"]
    assert "trials" not in first["items"][0] and first["items"][0]["counts"]["running"] == 0
    rest = client.get(
        "/v1/sweeps", params={"limit": 2, "cursor": first["next_cursor"]}, headers=alice
    ).json()
    assert [s["id"] for s in rest["items"]] == ids[:1] and rest["next_cursor"] is None
    client.post(f"/v1/sweeps/{ids[1]}/cancel", headers=alice)
    got = client.get("/v1/sweeps", params={"state": "cancelled"}, headers=alice).json()
    assert [s["id"] for s in got["items"]] == [ids[1]]
    assert problems(client.get("/v1/sweeps", params={"state": "nope"}, headers=alice)).keys() == {
        "state"
    }
    bad = client.get("/v1/sweeps", params={"cursor": "nope"}, headers=alice)
    assert problems(bad).keys() == {"cursor"}


def test_cancel_is_202_and_idempotent(client: TestClient, alice: Headers) -> None:
    sid = client.post("/v1/sweeps", json=BODY, headers=alice).json()["id"]
    for _ in range(2):
        r = client.post(f"/v1/sweeps/{sid}/cancel", headers=alice)
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "cancelled" and r.json()["finished_at"]


def test_the_openapi_schema_documents_the_routes(client: TestClient, factory: Factory) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/sweeps", "/v1/sweeps/{sweep_id}", "/v1/sweeps/{sweep_id}/cancel"} <= set(paths)
    body_schema = paths["/v1/sweeps"]["post"]["requestBody"]["content"]["application/json"]
    assert "space" in str(body_schema)


def test_the_example_sweep_file_is_accepted(client: TestClient, alice: Headers) -> None:
    from pathlib import Path

    from torchyard.client.sdk import load_spec

    example = Path(__file__).resolve().parents[2] / "examples" / "sweeps" / "digits_asha.yaml"
    r = client.post("/v1/sweeps", json=load_spec(example), headers=alice)
    assert r.status_code == 201, r.text
    s = r.json()
    assert (s["max_trials"], s["parallel"], s["sampler"], s["pruner"]) == (16, 2, "tpe", "asha")
