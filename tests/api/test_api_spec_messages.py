"""POST /v1/jobs says what to fix: the value received for a wrong type, the field meant for
an unknown one, every problem at once (the spec's and the server's), and, for a spec that is
allowed but likely not meant, warnings in the 201 answer while the job is stored."""

from __future__ import annotations

import copy
import gzip
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC, Factory

DIGITS = {
    "model": {"name": "mlp"},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd"},
    "batch_size": 64,
}


def _problems(r: Any) -> dict[str, str]:
    assert r.status_code == 422, r.text
    return {d["field"]: d["message"] for d in r.json()["error"]["details"]}


def _jobs(client: TestClient, headers: dict[str, str]) -> int:
    return len(client.get("/v1/jobs", headers=headers).json()["items"])


WRONG_TYPES = {"epochs": "5", "compile": "yes", "optimizer": {"name": "sgd", "lr": "1e-3"}}
UNKNOWN = {
    "lr": 0.1,
    "schedule": {"name": "cosine", "warmup": 5},
    "model": {"name": "mlp", "hiden": [64]},
}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            WRONG_TYPES,  # the value received, for a value of the wrong type
            {
                "optimizer.lr": 'must be a number, got "1e-3" (a string)',
                "epochs": 'must be an integer, got "5" (a string)',
                "compile": 'must be true or false, got "yes" (a string)',
            },
        ),
        (
            UNKNOWN,  # the field meant, for an unknown one, at any depth
            {
                "model.hiden": "unknown field (did you mean 'hidden'?)",
                "schedule.warmup": "unknown field (did you mean 'warmup_steps'?)",
                "lr": "unknown field (did you mean 'optimizer.lr'?)",
            },
        ),
    ],
    ids=["wrong-types", "unknown-fields"],
)
def test_a_problem_says_what_to_fix(
    client: TestClient, alice: dict[str, str], change: dict[str, Any], expected: dict[str, str]
) -> None:
    spec = copy.deepcopy(DIGITS) | change
    assert _problems(client.post("/v1/jobs", json=spec, headers=alice)) == expected


def test_every_problem_at_once_spec_and_server(client: TestClient, alice: dict[str, str]) -> None:
    """world_size 1000: the batch it does not divide and the server's limit, in one 422; a
    data set that is not on the server beside a field error."""
    big = DIGITS | {"world_size": 1000}
    got = _problems(client.post("/v1/jobs", json=big, headers=alice))
    assert got == {
        "batch_size": "must be divisible by world_size (1000)",
        "world_size": "must be <= 64 (TORCHYARD_MAX_WORLD_SIZE)",
    }
    missing = DIGITS | {"data": {"name": "mnist"}, "epochs": 0}
    got = _problems(client.post("/v1/jobs", json=missing, headers=alice))
    assert set(got) == {"epochs", "data.name"}
    assert "data set 'mnist' is not on the server; looked for " in got["data.name"]
    # The spec's own complaint about a field comes alone, not doubled by the server's.
    got = _problems(client.post("/v1/jobs", json=DIGITS | {"world_size": 2000}, headers=alice))
    assert got["world_size"] == "must be <= 1024"
    assert _jobs(client, alice) == 0


def test_a_world_size_above_the_registered_workers_is_stored_with_a_warning(
    client: TestClient, alice: dict[str, str], factory: Factory
) -> None:
    r = client.post("/v1/jobs", json=DIGITS, headers=alice)
    assert r.status_code == 201 and r.json()["warnings"] == []  # none registered, one asked
    factory.worker("cpu-0", device="cpu", gpu=None)
    factory.worker("cpu-1", device="cpu", gpu=None)
    factory.worker("h100-0", device="cuda", device_name="NVIDIA H100", gpu=0)
    r = client.post("/v1/jobs", json=DIGITS | {"world_size": 4}, headers=alice)
    assert r.status_code == 201, r.text
    [w] = r.json()["warnings"]
    assert w["field"] == "world_size"
    assert w["message"].startswith("4 is more than the largest group of one kind registered")
    assert "2 cpu, 1 NVIDIA H100" in w["message"] and "waits in the queue" in w["message"]
    assert client.get(f"/v1/jobs/{r.json()['id']}", headers=alice).json()["state"] == "queued"
    r = client.post("/v1/jobs", json=DIGITS | {"world_size": 2}, headers=alice)
    assert r.json()["warnings"] == []  # two CPU workers can take it
    assert _jobs(client, alice) == 3


def test_a_batch_larger_than_the_training_set_is_stored_with_a_warning(
    client: TestClient, alice: dict[str, str]
) -> None:
    r = client.post("/v1/jobs", json=DIGITS | {"batch_size": 2048}, headers=alice)
    assert r.status_code == 201, r.text
    assert r.json()["warnings"] == [
        {
            "field": "batch_size",
            "message": "2048 is more than the training set's 1438 samples ('digits', "
            "val_fraction 0.2): each epoch is one step over the whole set",
        }
    ]
    small = copy.deepcopy(SPEC) | {"batch_size": 32}  # synthetic: 64 samples, 51 to train
    assert client.post("/v1/jobs", json=small, headers=alice).json()["warnings"] == []
    # The answer to a retry with the same Idempotency-Key carries them too.
    key = {"Idempotency-Key": "k1", **alice}
    first = client.post("/v1/jobs", json=DIGITS | {"batch_size": 4096}, headers=key)
    again = client.post("/v1/jobs", json=DIGITS | {"batch_size": 4096}, headers=key)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["warnings"] == first.json()["warnings"] != []
    assert "warnings" not in client.get(f"/v1/jobs/{first.json()['id']}", headers=alice).json()


def _idx(count: int, *dims: int) -> bytes:
    header = bytes([0, 0, 8, 1 + len(dims)]) + b"".join(
        d.to_bytes(4, "big") for d in (count, *dims)
    )
    return header + bytes(count * (dims[0] * dims[1] if dims else 1))


def test_the_training_set_size_comes_from_the_data_root(
    client: TestClient, alice: dict[str, str], app: Any
) -> None:
    raw = Path(app.state.settings.data) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 100), ("t10k", 20)):
        (raw / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(n, 28, 28)))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(n))
    spec = DIGITS | {"data": {"name": "mnist"}, "batch_size": 128}
    r = client.post("/v1/jobs", json=spec, headers=alice)
    assert r.status_code == 201, r.text
    [w] = r.json()["warnings"]
    assert w["message"].startswith("128 is more than the training set's 100 samples ('mnist')")
