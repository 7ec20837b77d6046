"""GET /v1/sweeps/{id}/importances on both databases: fractions summing to 1 from the
sweep's Optuna study (trials added straight through Optuna, as the controller's would be),
the same answer every time, another user's sweep a 404, and an empty answer with its
reason while the trials cannot tell."""

from __future__ import annotations

import math
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from torchyard.api.sweep_importance import storage

Headers = dict[str, str]

SPACE: dict[str, Any] = {
    "optimizer.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True},
    "batch_size": {"type": "categorical", "choices": [32, 64, 128]},
}
DISTS = {
    "optimizer.lr": FloatDistribution(0.001, 0.3, log=True),
    "batch_size": CategoricalDistribution([32, 64, 128]),
}
BODY: dict[str, Any] = {
    "name": "imp",
    "spec": {"model": {"name": "mlp", "hidden": [16]}, "data": {"name": "digits"},
             "optimizer": {"name": "sgd", "lr": 0.05}, "epochs": 1, "seed": 1},
    "space": SPACE,
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 8,
}  # fmt: skip
# lr decides the value; batch_size barely moves it.
TRIALS = [(0.001, 32, 0.50), (0.003, 64, 0.61), (0.01, 128, 0.70), (0.03, 32, 0.79),
          (0.1, 64, 0.86), (0.3, 128, 0.90)]  # fmt: skip


def new_sweep(client: TestClient, headers: Headers) -> str:
    r = client.post("/v1/sweeps", json=BODY, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def add_trials(db_url: str, sweep_id: str, trials: list[tuple[float, int, float]]) -> None:
    """The sweep's study with these complete trials, and one pruned one (not counted)."""
    study = optuna.create_study(
        study_name=sweep_id, storage=storage(db_url), direction="maximize", load_if_exists=True
    )
    for lr, bs, value in trials:
        params = {"optimizer.lr": lr, "batch_size": bs}
        study.add_trial(create_trial(params=params, distributions=DISTS, value=value))
    pruned = {"optimizer.lr": 0.002, "batch_size": 32}
    study.add_trial(create_trial(params=pruned, distributions=DISTS,
                                 intermediate_values={1: 0.1}, state=TrialState.PRUNED))  # fmt: skip


def importances(client: TestClient, sweep_id: str, headers: Headers) -> Any:
    r = client.get(f"/v1/sweeps/{sweep_id}/importances", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_importances_sum_to_one_and_are_stable(
    client: TestClient, alice: Headers, admin: Headers, db_url: str
) -> None:
    sid = new_sweep(client, alice)
    add_trials(db_url, sid, TRIALS)
    got = importances(client, sid, alice)
    assert got["trials"] == len(TRIALS) and got["reason"] is None
    assert set(got["importances"]) == set(SPACE)
    assert math.isclose(sum(got["importances"].values()), 1.0, abs_tol=1e-6)
    assert next(iter(got["importances"])) == "optimizer.lr"  # largest first
    assert got["importances"]["optimizer.lr"] > 0.5
    assert importances(client, sid, alice) == got  # seeded: the same fractions again
    assert importances(client, sid, admin) == got  # admins see every sweep


def test_another_users_sweep_is_404(
    client: TestClient, alice: Headers, bob: Headers, db_url: str
) -> None:
    sid = new_sweep(client, alice)
    add_trials(db_url, sid, TRIALS)
    for path in (f"/v1/sweeps/{sid}/importances", "/v1/sweeps/nope/importances"):
        r = client.get(path, headers=bob)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"code": "not_found", "message": "sweep not found", "details": None}  # fmt: skip
    assert client.get(f"/v1/sweeps/{sid}/importances").status_code == 401


@pytest.mark.parametrize(
    ("trials", "reason"),
    [
        (None, "needs at least 2 complete trials (has 0)"),  # no study yet
        ([], "needs at least 2 complete trials (has 0)"),
        (TRIALS[:1], "needs at least 2 complete trials (has 1)"),
        ([(0.01, 64, 0.5), (0.01, 64, 0.7)], "every complete trial has the same parameter values"),
        ([(0.01, 64, 0.5), (0.1, 32, 0.5)], "every complete trial has the same objective value"),
    ],
)
def test_trials_that_cannot_tell_answer_why(
    client: TestClient,
    alice: Headers,
    db_url: str,
    trials: list[tuple[float, int, float]] | None,
    reason: str,
) -> None:
    sid = new_sweep(client, alice)
    if trials is not None:
        add_trials(db_url, sid, trials)
    got = importances(client, sid, alice)
    assert got == {"importances": {}, "trials": len(trials or []), "reason": reason}


def test_the_openapi_schema_documents_the_route(client: TestClient, alice: Headers) -> None:
    doc = client.get("/openapi.json", headers=alice).json()
    op = doc["paths"]["/v1/sweeps/{sweep_id}/importances"]["get"]
    assert {"200", "404"} <= set(op["responses"])
