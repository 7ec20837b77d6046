"""Hostile tenants and model size at submit (issue 25, "The size limit skips
`torchvision/<name>` models"): a torchvision model's `model.args` are counted on the meta
device before the job is stored, within bounds (scheduler/modelsize.py), on every entry
of the one submit path. On SQLite and PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC
from test_submit_paths import (  # the API's fixtures and the submit helpers
    SWEEP_BODY,
    Headers,
    alice,
    app,
    client,
    error,
)

from torchyard.scheduler import modelsize
from torchyard.store.db import session_scope
from torchyard.store.models import Job, Sweep

__all__ = ["alice", "app", "client"]
pytestmark = pytest.mark.hostile
IMAGES = {"name": "synthetic", "shape": [3, 16, 16], "num_classes": 4, "size": 64}


def _spec(model: dict[str, Any]) -> dict[str, Any]:
    return SPEC | {"model": model, "data": IMAGES}


def _stored(url: str, table: type) -> int:
    with session_scope(url) as s:
        return s.query(table).count()


def _details(err: dict[str, Any]) -> dict[str, str]:
    return {d["field"]: d["message"] for d in err["details"]}


def test_a_torchvision_model_too_large_for_its_args_is_422_quickly(
    client: TestClient, alice: Headers, db_url: str
) -> None:
    """Before: a 201 for ~11.9 T parameters, while an mlp of 2.95 G was refused."""
    ok = client.post("/v1/jobs", json=_spec({"name": "torchvision/resnet18"}), headers=alice)
    assert ok.status_code == 201, ok.text  # (torch is imported by now)
    huge = {"name": "torchvision/resnet50", "args": {"width_per_group": 65536}}
    started = time.monotonic()
    r = client.post("/v1/jobs", json=_spec(huge), headers=alice)
    assert time.monotonic() - started < 2.0
    message = _details(error(r, 422, "validation_error"))["model.args"]
    assert "torchvision/resnet50 has ~11.9 T parameters" in message
    assert "at most 2 G (TORCHYARD_MAX_MODEL_PARAMS)" in message
    assert _stored(db_url, Job) == 1


@pytest.mark.parametrize(
    ("model", "field", "words"),
    [
        ({"name": "torchvision/resnet50", "args": {"widht_per_group": 64}},
         "model.args.widht_per_group", "takes no argument 'widht_per_group'"),
        ({"name": "torchvision/resnet50", "args": {"num_classes": 5}},
         "model.args.num_classes", "sets 'num_classes' itself"),
        ({"name": "torchvision/resnet50", "args": {"norm_layer": "x"}},
         "model.args", "cannot be built with these args: TypeError"),
        ({"name": "torchvision/resnet50", "args": {"width_per_group": 2**62}},
         "model.args", "cannot be built with these args"),
        ({"name": "torchvision/resnet5"}, "model.name", "did you mean resnet50"),
        # a small spec that would make 100,000 blocks: stopped by the module bound
        ({"name": "torchvision/mobilenet_v2",
          "args": {"inverted_residual_setting": [[1, 16, 100000, 1]]}},
         "model.args", f"more than {modelsize.MAX_MODULES} modules"),
    ],
)  # fmt: skip
def test_args_a_torchvision_model_does_not_take_are_422_naming_them(
    client: TestClient, alice: Headers, db_url: str, model: dict, field: str, words: str
) -> None:
    started = time.monotonic()
    err = error(client.post("/v1/jobs", json=_spec(model), headers=alice), 422, "validation_error")
    assert time.monotonic() - started < modelsize.BUILD_WALL_S + 10  # (the first imports torch)
    assert words in _details(err).get(field, ""), err
    assert _stored(db_url, Job) == 0


def test_a_sweep_over_torchvision_args_is_checked_at_each_value(
    client: TestClient, alice: Headers, db_url: str
) -> None:
    space = {"model.args.width_per_group": {"type": "categorical", "choices": [64, 65536]}}
    body = SWEEP_BODY | {"spec": _spec({"name": "torchvision/resnet50"}), "space": space}
    err = error(client.post("/v1/sweeps", json=body, headers=alice), 422, "validation_error")
    assert "~11.9 T parameters" in str(err["details"]), err
    assert _stored(db_url, Sweep) == 0


def test_every_torchvision_classification_model_is_counted_with_its_defaults() -> None:
    """No model of torchvision is refused for being uncountable (RegNets need the retry)."""
    from torchvision import models as tvm

    from torchyard.contracts.spec import parse_spec

    for name in tvm.list_models(module=tvm):
        spec = parse_spec(_spec({"name": f"torchvision/{name}"}))
        assert modelsize.torchvision_problems(spec, 2_000_000_000) == [], name
