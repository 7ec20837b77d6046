"""One submit path (scheduler/submit.py): a job (POST /v1/jobs), a sweep's specs at creation
(POST /v1/sweeps) and a trial the sweep controller asks for later all go through it, so one
rule patched in the service's rules module is seen by all three. And the checks the sweep
paths make since they take it: the priority rule at creation; at a trial, the permission to
run code, the priority rule, and the data set being on the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from support.db import SPEC, Factory

from torchyard.api.app import create_app
from torchyard.scheduler import submitchecks
from torchyard.scheduler.submit import SubmitRefused
from torchyard.scheduler.sweeps import SweepController
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.jobs import Viewer
from torchyard.store.sweeps import NewSweep, create_sweep, sweep_view

Headers = dict[str, str]
LR = {"optimizer.lr": {"type": "categorical", "choices": [0.1, 0.01, 0.001]}}
SWEEP_BODY: dict[str, Any] = {
    "spec": SPEC,
    "space": LR,
    "objective": {"metric": "val/accuracy", "mode": "max"},
    "trials": 3,
    "sampler": "grid",
}
RULE = "refused by the one rule this test patches"


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def alice(factory: Factory) -> Headers:
    return {"Authorization": f"Bearer {factory.token('alice')}"}


def stored_sweep(factory: Factory, spec: dict[str, Any] = SPEC, max_trials: int = 1) -> str:
    """Alice's sweep as POST /v1/sweeps stores it (its trials are the controller's to queue)."""
    new = NewSweep(
        name="s", spec=spec, space=LR, metric="val/accuracy", mode="max", max_trials=max_trials,
        parallel=1, sampler="grid", pruner="none", seed=0,
    )  # fmt: skip
    with session_scope(factory.url) as s:
        return create_sweep(s, factory.user_id("alice"), new).id


def trials(url: str, sweep_id: str) -> list[dict[str, Any]]:
    with session_scope(url) as s:
        view = sweep_view(s, Viewer(0, is_admin=True), sweep_id)
        assert view is not None
        return view["trials"]


def failed_trial(settings: Settings, sweep_id: str) -> str:
    """Run the controller's pass; the trial it asked for was refused: its error."""
    assert SweepController(settings).run_pass() == 0
    (trial,) = trials(settings.db_url, sweep_id)
    assert trial["job_id"] is None and trial["status"] == "failed", trial
    return str(trial["error"])


def error(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    return dict(err)


# -- one rule, three paths -------------------------------------------------------------------


def test_a_patched_problem_rule_is_seen_by_a_job_a_sweep_and_a_later_trial(
    client: TestClient, alice: Headers, factory: Factory, settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    sid = stored_sweep(factory, max_trials=2)
    controller = SweepController(settings)
    assert controller.run_pass() == 1  # trial 0 queued before the rule changes
    (first,) = trials(settings.db_url, sid)
    factory.set_state(first["job_id"], "cancelled")  # its job ends: the next is asked for

    monkeypatch.setattr(submitchecks, "limit_problems", lambda *_: [("model", RULE)])

    err = error(client.post("/v1/jobs", json=SPEC, headers=alice), 422, "validation_error")
    assert {"field": "model", "message": RULE} in err["details"]
    err = error(client.post("/v1/sweeps", json=SWEEP_BODY, headers=alice), 422, "validation_error")
    assert {"field": "spec.model", "message": RULE} in err["details"]
    assert controller.run_pass() == 0
    later = trials(settings.db_url, sid)[1]
    assert later["job_id"] is None and later["error"] == f"invalid spec: model: {RULE}"

    monkeypatch.undo()  # and without it, each path goes on as before
    assert client.post("/v1/jobs", json=SPEC, headers=alice).status_code == 201
    again = client.post("/v1/sweeps", json=SWEEP_BODY, headers=alice)
    assert again.status_code == 201
    assert controller.run_pass() == 1
    assert trials(settings.db_url, again.json()["id"])[0]["job_id"] is not None


def test_a_patched_refusal_rule_is_seen_by_a_job_a_sweep_and_a_trial(
    client: TestClient, alice: Headers, factory: Factory, settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    sid = stored_sweep(factory)

    def refuse(*_: Any) -> SubmitRefused:
        return SubmitRefused("forbidden", RULE)

    monkeypatch.setattr(submitchecks, "code_refusal", refuse)
    err = error(client.post("/v1/jobs", json=SPEC, headers=alice), 403, "forbidden")
    assert err["message"] == RULE
    err = error(client.post("/v1/sweeps", json=SWEEP_BODY, headers=alice), 403, "forbidden")
    assert err["message"] == RULE
    assert failed_trial(settings, sid) == RULE


def test_the_quota_rule_holds_trials_back_and_refuses_a_job(
    client: TestClient, alice: Headers, factory: Factory, settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    sid = stored_sweep(factory)

    def full(*_: Any) -> SubmitRefused:
        return SubmitRefused("quota_exceeded", RULE, details=[{"field": "max_queued"}])

    monkeypatch.setattr(submitchecks, "queue_refusal", full)
    err = error(client.post("/v1/jobs", json=SPEC, headers=alice), 429, "quota_exceeded")
    assert (err["message"], err["details"]) == (RULE, [{"field": "max_queued"}])
    assert SweepController(settings).run_pass() == 0
    assert trials(settings.db_url, sid) == []  # waits: not asked for, not failed


# -- what the sweep paths check since they take the one path -------------------------------------


def test_a_sweep_asking_a_priority_only_admins_may_give_is_403(
    client: TestClient, alice: Headers
) -> None:
    spec = SPEC | {"priority": 5, "preemptible": False}
    r = client.post("/v1/sweeps", json=SWEEP_BODY | {"spec": spec}, headers=alice)
    assert (
        "only admins may give a job with preemptible: false"
        in error(r, 403, "forbidden")["message"]
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model": {"name": "mynets:small"}}, "may not run their own code"),
        ({"priority": 5, "preemptible": False}, "only admins may give a job"),
        ({"data": {"name": "mnist"}}, "data set 'mnist' is not on the server"),
        ({"world_size": 65}, "world_size: must be <= 64 (TORCHYARD_MAX_WORLD_SIZE)"),
    ],
)
def test_a_trial_the_owner_may_not_submit_fails_without_a_job(
    factory: Factory, settings: Settings, change: dict[str, Any], words: str
) -> None:
    """A sweep stored before (its owner's permission or the server changed since): each
    trial is submitted as its owner, as POST /v1/jobs would submit it."""
    sid = stored_sweep(factory, spec=SPEC | change)
    assert words in failed_trial(settings, sid)
