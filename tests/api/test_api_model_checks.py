"""A submit's model builds are bounded (api/lanes.py, scheduler/modelsize.py): a model
counted once is cached, a request builds at most TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST
(422 naming the sweep's parameter), and a user has at most
TORCHYARD_MAX_MODEL_CHECKS_PER_USER submits building at once (429). The attack they stop
is tests/api/test_hostile_costs.py's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_hostile_costs import model_sweep

from torchyard.api.app import create_app
from torchyard.api.errors import ApiError
from torchyard.api.lanes import ModelChecks
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Sweep

_widths = iter(range(65, 10**6))  # models no other test counted: never in the cache


def test_a_sweep_past_the_build_bound_is_422_and_what_it_counted_is_cached(
    settings: Settings, db_url: str, alice: dict[str, str]
) -> None:
    app = create_app(settings.model_copy(update={"max_model_checks_per_request": 2}))
    widths = [next(_widths) for _ in range(3)]  # with the base: 3 or 4 models
    body = model_sweep(widths, "resnet50", "width_per_group")
    with TestClient(app) as client:
        r = client.post("/v1/sweeps", json=body, headers=alice)
        assert r.status_code == 422, r.text
        [problem] = r.json()["error"]["details"]
        assert problem["field"] == "space.model.args.width_per_group"
        assert "more than 2 different torchvision models" in problem["message"]
        assert "TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST" in problem["message"]
        with session_scope(db_url) as s:
            assert s.query(Sweep).count() == 0
        # The 2 built before the bound are cached: asked again, they cost nothing.
        again = client.post("/v1/sweeps", json=body, headers=alice)
        assert again.status_code == 201, again.text


def test_a_user_has_one_submit_building_at_a_time() -> None:
    checks = ModelChecks(per_user=1, per_request=8)
    with checks.bounded(1) as first:
        first.charge("a")  # its first build claims the user's slot
        with checks.bounded(1) as second, pytest.raises(ApiError) as refused:
            second.charge("b")
        assert refused.value.status == 429
        assert refused.value.code == "too_many_model_checks"
        assert "TORCHYARD_MAX_MODEL_CHECKS_PER_USER" in refused.value.message
        assert refused.value.headers == {"Retry-After": "5"}
        with checks.bounded(1):
            pass  # a submit whose models are all cached never claims
        with checks.bounded(2) as other_user:
            other_user.charge("b")
        first.charge("a")  # the same model again: charged once
    with checks.bounded(1) as later:
        later.charge("b")  # the slot came back
    assert not checks.held
