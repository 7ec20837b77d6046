"""Hostile tenants, issue 42 (review item 7): an admin's rights could not be taken back.
They are the user's, not a token's, so revoking the token made with `--admin` left an older
plain token an admin; `PATCH /v1/users/{name}` takes them back, at once, for every token
and dashboard session of the user, cached ones included."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.app import create_app
from torchyard.settings import Settings
from torchyard.store.auth import hash_token

pytestmark = pytest.mark.hostile


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_demoted_admin_loses_admin_on_every_token_at_once(
    client: TestClient, factory: Factory, settings: Settings, admin: dict[str, str]
) -> None:
    plain = factory.token("carol")  # the older, plain token
    elevated = factory.token("carol", admin=True)  # `token create --admin` promotes carol
    job = factory.job("bob")

    def rights(c: TestClient, headers: dict[str, str]) -> tuple[int, int]:
        """(another user's job: 200 for an admin, 404 else; an admins-only route)."""
        seen = c.get(f"/v1/jobs/{job}", headers=headers).status_code
        return seen, c.put("/v1/users/bob/quota", json={}, headers=headers).status_code

    # The finding: revoking the admin token leaves the plain one an admin.
    [row] = [t for t in client.get("/v1/tokens", headers=admin).json()["items"]
             if t["user"] == "carol" and t["prefix"] == elevated[:10]]  # fmt: skip
    assert client.delete(f"/v1/tokens/{row['id']}", headers=admin).status_code == 204
    assert rights(client, _bearer(plain)) == (200, 200)
    cookie = client.post("/v1/ui/sessions", json={}, headers=_bearer(plain)).cookies["ty_session"]
    session = {"Cookie": f"ty_session={cookie}"}
    assert client.get("/v1/ui/session", headers=session).json()["is_admin"] is True
    # Another API process on the same store, its cache warm with carol the admin too.
    with TestClient(create_app(settings)) as other:
        assert rights(other, _bearer(plain)) == (200, 200)
        cached = client.app.state.token_cache.get(hash_token(plain))  # type: ignore[attr-defined]
        assert cached is not None and cached.is_admin

        r = client.patch("/v1/users/carol", json={"admin": False}, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json() == {"user": "carol", "admin": False, "can_run_code": False}

        assert rights(client, _bearer(plain)) == (404, 403)
        assert client.get("/v1/ui/session", headers=session).json()["is_admin"] is False
        # The other process: its admins-only routes read the user afresh.
        assert other.put("/v1/users/bob/quota", json={}, headers=_bearer(plain)).status_code == 403
