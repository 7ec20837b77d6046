"""POST /v1/jobs refuses a spec whose model or data set is beyond the server's size limits
(TORCHYARD_MAX_MODEL_PARAMS, TORCHYARD_MAX_DATA_BYTES) with a 422 naming the field, the
estimate and the limit, and stores nothing; a spec within them is accepted."""

from __future__ import annotations

import copy
from typing import Any

from fastapi.testclient import TestClient
from support.db import SPEC


def _jobs(client: TestClient, headers: dict[str, str]) -> int:
    r = client.get("/v1/jobs", headers=headers)
    assert r.status_code == 200, r.text
    return len(r.json()["items"])


def _refused(r: Any) -> dict[str, Any]:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    return err


def test_a_wide_mlp_is_refused_and_not_stored(client: TestClient, alice: dict[str, str]) -> None:
    ok = client.post("/v1/jobs", json=SPEC, headers=alice)
    assert ok.status_code == 201, ok.text
    before = _jobs(client, alice)
    wide = copy.deepcopy(SPEC)
    wide["model"]["hidden"] = [65536] * 16  # each width allowed; ~64.4 G parameters together
    err = _refused(client.post("/v1/jobs", json=wide, headers=alice))
    assert [d["field"] for d in err["details"]] == ["model.hidden"]
    message = err["details"][0]["message"]
    assert "~64.4 G parameters" in message and "at most 2 G" in message
    assert "TORCHYARD_MAX_MODEL_PARAMS" in message and "model.hidden" in err["message"]
    assert _jobs(client, alice) == before == 1


def test_the_limits_come_from_the_settings(
    client: TestClient, alice: dict[str, str], app: Any
) -> None:
    # SPEC's mlp 64-16-4 has 1108 parameters; its 64 samples take 64 * (64 + 8) bytes.
    app.state.settings = app.state.settings.model_copy(
        update={"max_model_params": 1108, "max_data_bytes": 64 * 72}
    )
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201
    app.state.settings = app.state.settings.model_copy(
        update={"max_model_params": 1107, "max_data_bytes": 64 * 72 - 1}
    )
    err = _refused(client.post("/v1/jobs", json=SPEC, headers=alice))
    by_field = {d["field"]: d["message"] for d in err["details"]}
    assert set(by_field) == {"model.hidden", "data"}
    assert "~1.11 K parameters" in by_field["model.hidden"]
    assert "at most 1.11 K" in by_field["model.hidden"]
    assert "TORCHYARD_MAX_DATA_BYTES" in by_field["data"] and "4.5 KiB" in by_field["data"]
    assert _jobs(client, alice) == 1


def test_a_big_synthetic_set_is_refused_naming_data(
    client: TestClient, alice: dict[str, str]
) -> None:
    big = copy.deepcopy(SPEC)
    big["data"] = {"name": "synthetic", "shape": [3, 1024, 1024], "size": 10_000}
    big["model"] = {"name": "lenet"}
    err = _refused(client.post("/v1/jobs", json=big, headers=alice))
    assert err["details"] == [{"field": "data", "message": err["details"][0]["message"]}]
    assert "~29.3 GiB" in err["message"] and "at most 16 GiB" in err["message"]
    assert _jobs(client, alice) == 0
