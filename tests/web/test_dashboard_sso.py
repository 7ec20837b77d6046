"""Single sign-on in a real browser: the login page's "Sign in with …" through a real
OpenID provider's pages (tests/oidc_provider.py) and back, signed in, to the page asked
for; logout; a user the provider does not know. The provider is at `localhost`, the
dashboard at 127.0.0.1: another site, as a company's provider is, so the cookies' SameSite
rules are those of a real deployment."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dashboard_lib import SQLITE, start_api
from oidc_provider import CLIENT_ID, CLIENT_SECRET, OidcProvider, start_provider
from support.worker_cluster import Cluster

pytestmark = pytest.mark.browser


class World:
    def __init__(self, c: Cluster, op: OidcProvider):
        self.c, self.op, self.base = c, op, c.url


@pytest.fixture(scope="module", params=[SQLITE])
def world(request: Any, tmp_path_factory: Any) -> Iterator[World]:
    url = None
    if request.param == "postgres":
        from support.db import drop_pg_databases, new_pg_database

        new_db = new_pg_database(request.getfixturevalue("pg_url"))
        request.addfinalizer(lambda: drop_pg_databases(new_db))
        url = new_db()
    folder = tmp_path_factory.mktemp(f"sso-{request.param}")
    c = Cluster(folder / "cluster", database_url=url)
    callback = f"{c.url}/v1/ui/sso/callback"
    with start_provider(folder / "oidc", [callback], issuer="http://localhost:{port}") as op:
        c.env.update(TORCHYARD_OIDC_ISSUER=op.issuer, TORCHYARD_OIDC_CLIENT_ID=CLIENT_ID,
                     TORCHYARD_OIDC_CLIENT_SECRET=CLIENT_SECRET, TORCHYARD_OIDC_NAME="Example SSO")  # fmt: skip
        try:
            start_api(c)
            yield World(c, op)
        finally:
            c.stop()


def test_sso_signs_in_at_the_provider_and_lands_on_the_page_asked_for(
    world: World, new_page: Callable[[], Any], shot: Callable[[Any, str], None]
) -> None:
    page = new_page()
    page.goto(world.base + "/workers")
    page.wait_for_selector("#sso")
    assert page.inner_text("#sso") == "Sign in with Example SSO"
    assert page.is_visible("#token")  # tokens keep working beside it
    shot(page, "sso-login")
    page.click("#sso")
    page.wait_for_selector("#login")
    assert page.url.startswith(world.op.issuer + "/interaction/")
    page.fill("#login", "alice")
    page.click("#sign-in")
    page.wait_for_selector("body[data-user]")
    assert page.url == world.base + "/workers"
    assert page.inner_text("#user") == "alice"
    cookies = {c["name"]: c for c in page.context.cookies(world.base)}
    assert cookies["ty_session"]["httpOnly"] and cookies["ty_session"]["sameSite"] == "Strict"
    assert "ty_sso" not in cookies  # the sign-in's binding cookie is gone with it
    assert page.evaluate("fetch('/v1/jobs').then(r => r.status)") == 200
    page.click("text=Log out")
    page.wait_for_selector("#sso")
    assert page.evaluate("fetch('/v1/jobs').then(r => r.status)") == 401
    # signed out of torchyard, still signed in at the provider: one click signs in again
    page.click("#sso")
    page.wait_for_selector("body[data-user]")
    assert page.inner_text("#user") == "alice"


def test_a_user_the_provider_does_not_know_gets_a_clear_page(
    world: World, new_page: Callable[[], Any]
) -> None:
    page = new_page()
    page.goto(world.base + "/login")
    page.click("#sso")
    page.fill("#login", "mallory")
    page.click("#sign-in")
    page.wait_for_selector("#sso-error")
    assert "no such user at the provider" in page.inner_text("#sso-error")
    page.click("text=Back to the sign-in page")
    page.wait_for_selector("#sso")
    assert page.evaluate("fetch('/v1/jobs').then(r => r.status)") == 401
