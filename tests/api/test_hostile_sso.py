"""Hostile tenants, issue 42 (review item 7): single sign-on bound a provider account to an
existing user by name, so an account whose `preferred_username` was `admin` became the
admin. A first sign-in under the name of a user not linked to that account is refused now;
admin rights come from single sign-on only through TORCHYARD_OIDC_ADMIN_GROUPS."""

from __future__ import annotations

import pytest
import test_sso
from fastapi.testclient import TestClient
from oidc_provider import USERS, OidcProvider
from sqlalchemy import select
from support.db import Factory
from test_sso import refused, sign_in

from torchyard.store.db import session_scope
from torchyard.store.models import ApiToken, User, UserIdentity

pytestmark = pytest.mark.hostile

provider = test_sso.provider
sso = test_sso.sso
_fresh_users = test_sso._fresh_users


def test_an_account_claiming_the_admins_name_gets_neither_admin_nor_the_account(
    sso: TestClient, provider: OidcProvider, factory: Factory, db_url: str
) -> None:
    root = factory.token("admin", admin=True)  # the admin `torchyard up` makes
    # Anyone may pick their preferred_username at many providers; no admin group here.
    provider.set_users({**USERS, "admin": {"sub": "sub-mallory", "groups": ["ml-team"]}})
    r = sign_in(sso, provider, "admin")
    refused(r, 403, "not linked to this sign-in account")
    assert "sub-mallory" in r.json()["error"]["message"]  # what the admin would link
    assert "torchyard user link" in r.json()["error"]["message"]
    assert sso.get("/v1/ui/session").status_code == 401
    with session_scope(db_url) as s:
        assert s.scalars(select(UserIdentity)).all() == []
        tokens = s.execute(select(User.name, ApiToken.label).join(ApiToken)).all()
        assert tokens == [("admin", None)]  # nothing was issued to anyone
    # The admin's own token is untouched, and the same account under its own name is an
    # ordinary user.
    assert sso.get("/v1/ui/session", headers={"Authorization": f"Bearer {root}"}).json()["is_admin"]
    provider.set_users({**USERS, "mallory": {"sub": "sub-mallory", "groups": ["ml-team"]}})
    assert sign_in(sso, provider, "mallory").status_code == 303
    me = sso.get("/v1/ui/session").json()
    assert (me["user"], me["is_admin"]) == ("mallory", False)
