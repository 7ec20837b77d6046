"""Hostile tenants and priority at submit (issue 25, "Any user can preempt everyone"):
priority is a permission, checked on the one submit path for a job, a sweep's whole
space at its creation, and each trial the controller queues. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import SPEC, Factory
from test_submit_paths import (  # the API's fixtures and the submit helpers
    SWEEP_BODY,
    Headers,
    alice,
    app,
    client,
    error,
    failed_trial,
    stored_sweep,
)

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Job, Sweep

__all__ = ["alice", "app", "client"]
pytestmark = pytest.mark.hostile
QUOTA = "/v1/users/alice/quota"


@pytest.fixture
def root(factory: Factory) -> Headers:
    return {"Authorization": f"Bearer {factory.token('root', admin=True)}"}


def _stored(url: str, table: type) -> int:
    with session_scope(url) as s:
        return s.query(table).count()


def test_a_user_may_not_submit_above_their_max_priority(
    client: TestClient, alice: Headers, root: Headers, db_url: str
) -> None:
    """Before: any preemptible priority up to 1000 was a 201, and it preempted others."""
    err = error(client.post("/v1/jobs", json=SPEC | {"priority": 1000}, headers=alice), 403,
                "forbidden")  # fmt: skip
    assert "priority 1000 is above this user's max_priority, 0" in err["message"]
    assert err["details"][0]["field"] == "priority" and err["details"][0]["limit"] == 0
    assert _stored(db_url, Job) == 0
    # ordering one's own work stays open: the default and below
    for p in (0, -1000):
        assert (
            client.post("/v1/jobs", json=SPEC | {"priority": p}, headers=alice).status_code == 201
        )
    # an admin raises the limit with the quota; the user cannot raise it
    error(client.put(QUOTA, json={"max_priority": 1000}, headers=alice), 403, "forbidden")
    assert client.put(QUOTA, json={"max_priority": 50}, headers=root).status_code == 200
    assert client.post("/v1/jobs", json=SPEC | {"priority": 50}, headers=alice).status_code == 201
    err = error(client.post("/v1/jobs", json=SPEC | {"priority": 51}, headers=alice), 403,
                "forbidden")  # fmt: skip
    assert err["details"][0]["limit"] == 50
    # and lowering it works at once (no cached permission)
    client.put(QUOTA, json={"max_priority": -10}, headers=root)
    error(client.post("/v1/jobs", json=SPEC, headers=alice), 403, "forbidden")
    # admins are not limited
    assert client.post("/v1/jobs", json=SPEC | {"priority": 1000}, headers=root).status_code == 201


def _sweep(spec: dict[str, Any], space: dict[str, Any]) -> dict[str, Any]:
    return SWEEP_BODY | {"spec": spec, "space": space, "sampler": "tpe"}


PIN = {"preemptible": {"type": "categorical", "choices": [True, False]}}
HIGH = {"priority": {"type": "int", "low": 0, "high": 1000}}


@pytest.mark.parametrize(
    ("spec", "space", "words"),
    [
        # both from the space: each value alone is allowed, together they are not
        (
            SPEC,
            PIN | HIGH | {"priority": {"type": "int", "low": 0, "high": 50}},
            "preemptible: false",
        ),
        # the base pins the job, the space raises its priority (and the reverse)
        (
            SPEC | {"preemptible": False},
            {"priority": {"type": "categorical", "choices": [0, 50]}},
            "preemptible: false",
        ),
        (SPEC | {"priority": 50}, PIN, "preemptible: false"),
        # a priority above the user's limit anywhere in the space
        (SPEC, HIGH, "above this user's max_priority, 50"),
        (
            SPEC,
            {"priority": {"type": "int", "low": 0, "high": 60, "step": 7}},
            "priority 56 in a trial of this sweep is above",
        ),
    ],
)
def test_a_sweep_is_refused_for_what_any_of_its_trials_may_not_do(
    client: TestClient, alice: Headers, root: Headers, db_url: str,
    spec: dict[str, Any], space: dict[str, Any], words: str,
) -> None:  # fmt: skip
    """Before: 201, although the same spec as a job is a 403."""
    client.put(QUOTA, json={"max_priority": 50}, headers=root)
    err = error(client.post("/v1/sweeps", json=_sweep(spec, space), headers=alice), 403,
                "forbidden")  # fmt: skip
    assert words in err["message"], err
    assert _stored(db_url, Sweep) == 0
    # an admin may
    assert client.post("/v1/sweeps", json=_sweep(spec, space), headers=root).status_code == 201


def test_a_sweep_within_the_limits_is_created(
    client: TestClient, alice: Headers, root: Headers
) -> None:
    client.put(QUOTA, json={"max_priority": 50}, headers=root)
    space = PIN | {"priority": {"type": "int", "low": -10, "high": 0}}
    assert client.post("/v1/sweeps", json=_sweep(SPEC, space), headers=alice).status_code == 201
    high = {"priority": {"type": "int", "low": 0, "high": 50}}
    assert client.post("/v1/sweeps", json=_sweep(SPEC, high), headers=alice).status_code == 201
    # 1, 8, …, 50: `high` itself is never sampled, so it is not what is checked
    stepped = {"priority": {"type": "int", "low": 1, "high": 55, "step": 7}}
    r = client.post("/v1/sweeps", json=_sweep(SPEC, stepped), headers=alice)
    assert r.status_code == 201, r.text


def test_a_trial_above_the_owners_max_priority_fails_without_a_job(
    factory: Factory, settings: Settings
) -> None:
    """A sweep stored before (or whose owner's limit was lowered since): each trial is
    submitted as its owner and refused like the job it would be."""
    sid = stored_sweep(factory, spec=SPEC | {"priority": 1000})
    assert "above this user's max_priority, 0" in failed_trial(settings, sid)
