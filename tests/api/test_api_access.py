"""Table-driven access rules, over every route the app has (a new route is covered
without editing this file): no token → 401; another user's job → 404."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.app import create_app
from torchyard.settings import Settings

# Single sign-on's steps (api/routers/sso.py) are public on purpose: each begins or ends a
# sign-in, before there is a token (tests/api/test_sso.py tests what they refuse).
SSO_STEPS = {"/v1/ui/sso", "/v1/ui/sso/login", "/v1/ui/sso/callback", "/v1/auth/device",
             "/v1/auth/device/token"}  # fmt: skip
PUBLIC = {"/healthz", "/readyz"} | SSO_STEPS


def _routes() -> list[tuple[str, str]]:
    app = create_app(Settings(_env_file=None, home="/nonexistent-torchyard"))  # type: ignore[call-arg]
    # From the OpenAPI document: every documented operation is tested.
    return [(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops]


ROUTES = _routes()
PROTECTED = [(m, p) for m, p in ROUTES if p not in PUBLIC]
JOB_ROUTES = [(m, p) for m, p in ROUTES if "{job_id}" in p]


def _fill(path: str, job_id: str) -> str:
    return re.sub(r"\{checkpoint\}", "latest", path.replace("{job_id}", job_id))


def test_the_tables_cover_the_design_routes() -> None:
    paths = {p for _, p in ROUTES}
    for p in (
        "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/metrics",
        "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/logs", "/v1/jobs/{job_id}/checkpoints",
        "/v1/jobs/{job_id}/checkpoints/{checkpoint}/download", "/v1/workers",
        "/healthz", "/readyz", "/metrics",
    ):  # fmt: skip
        assert p in paths
    for m, p in (
        ("PATCH", "/v1/jobs/{job_id}"), ("DELETE", "/v1/jobs/{job_id}"),
        ("POST", "/v1/jobs/{job_id}/archive"), ("POST", "/v1/jobs/{job_id}/unarchive"),
    ):  # fmt: skip
        assert (m, p) in ROUTES
    # the 7 above, the dashboard's stream-start, the 4 of organising a job, and the 2 of its
    # artifacts (list, download)
    assert len(JOB_ROUTES) == 14
    assert ("GET", "/v1/jobs/{job_id}/artifacts/{name}/download") in ROUTES


BAD_AUTH = [None, "Bearer ty_not-a-real-token", "Basic YWxpY2U6eA==", "Bearer ", "ty_no-scheme"]


@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_every_route_needs_a_token(
    client: TestClient, factory: Factory, method: str, path: str
) -> None:
    job_id = factory.job("alice")
    for auth in BAD_AUTH:
        headers = {"Authorization": auth} if auth is not None else {}
        r = client.request(method, _fill(path, job_id), headers=headers, json={})
        assert r.status_code == 401, (method, path, auth, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"


def test_revoked_token_is_refused(client: TestClient, factory: Factory, db_url: str) -> None:
    from sqlalchemy import update

    from torchyard.store.db import session_scope
    from torchyard.store.models import ApiToken, utcnow

    token = factory.token("carol")
    with session_scope(db_url) as s:
        s.execute(update(ApiToken).values(revoked_at=utcnow()))
    r = client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401


@pytest.mark.parametrize(("method", "path"), JOB_ROUTES, ids=[f"{m} {p}" for m, p in JOB_ROUTES])
def test_another_users_job_is_404_on_every_job_route(
    client: TestClient,
    factory: Factory,
    alice: dict[str, str],
    bob: dict[str, str],
    method: str,
    path: str,
) -> None:
    job_id = factory.job("alice", state="succeeded")
    kw: dict[str, Any] = {"json": {}} if method in ("POST", "PATCH") else {}
    r = client.request(method, _fill(path, job_id), headers=bob, **kw)
    assert r.status_code == 404, (method, path, r.text)
    assert r.json()["error"]["code"] == "not_found"
    # and the job is untouched and visible to its owner
    assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["state"] == "succeeded"
    # a job id that does not exist is the same 404
    r = client.request(method, _fill(path, "0" * 32), headers=alice, **kw)
    assert r.status_code == 404


def test_unknown_route_and_method_use_the_error_shape(
    client: TestClient, alice: dict[str, str]
) -> None:
    r = client.get("/v1/nothing", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.delete("/v1/jobs", headers=alice)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
