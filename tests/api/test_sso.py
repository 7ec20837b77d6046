"""Single sign-on against a real OpenID provider (node-oidc-provider, tests/oidc_provider.py),
on each database: the dashboard's code flow driven through the provider's pages with httpx,
the device flow's API, and every refusal (wrong issuer, wrong audience, an expired ID token,
a replayed or foreign state, a user removed at the provider, another account under an
existing user's name until an admin links it), the groups' mapping to admins and project roles, logout, and a provider that is down."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from oidc_provider import (
    CLIENT_ID,
    CLIENT_SECRET,
    OTHER_ID,
    OTHER_SECRET,
    USERS,
    OidcProvider,
    start_provider,
)
from sqlalchemy import select, update
from support.db import Factory

from torchyard.api import oidc
from torchyard.api.app import create_app
from torchyard.api.oidc import OidcError
from torchyard.api.routers import sso as sso_routes
from torchyard.settings import Settings
from torchyard.store.auth import get_or_create_user
from torchyard.store.db import session_scope
from torchyard.store.models import ApiToken, AuditEntry, UiSession, User, utcnow
from torchyard.store.projects import create_project, project_named, role_of, set_member

CALLBACK = "http://testserver/v1/ui/sso/callback"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    with start_provider(tmp_path_factory.mktemp("oidc"), [CALLBACK]) as op:
        yield op


@pytest.fixture(autouse=True)
def _fresh_users(provider: OidcProvider) -> None:
    provider.set_users(dict(USERS))


def sso_settings(settings: Settings, op: OidcProvider, **over: Any) -> Settings:
    return settings.model_copy(
        update={
            "oidc_issuer": op.issuer,
            "oidc_client_id": CLIENT_ID,
            "oidc_client_secret": CLIENT_SECRET,
            "oidc_admin_groups": "admins",
            "oidc_project_roles": "ml-team=lab:member,ml-leads=lab:owner",
            **over,
        }
    )


@pytest.fixture
def sso(settings: Settings, provider: OidcProvider) -> Iterator[TestClient]:
    with TestClient(create_app(sso_settings(settings, provider))) as c:
        yield c


def start(client: TestClient, next_path: str | None = None) -> str:
    """GET /v1/ui/sso/login: the provider URL it sends the browser to."""
    r = client.get("/v1/ui/sso/login", params={"next": next_path} if next_path else None,
                   follow_redirects=False)  # fmt: skip
    assert r.status_code == 302, r.text
    return r.headers["location"]


def at_provider(op: OidcProvider, url: str, user: str, abort: bool = False) -> str:
    """The callback URL the provider sends the browser back with."""
    with httpx.Client(timeout=20) as browser:
        back = op.sign_in(browser, url, user, abort=abort)
    assert back.startswith(CALLBACK), back
    return back


def sign_in(client: TestClient, op: OidcProvider, user: str) -> httpx.Response:
    return client.get(at_provider(op, start(client), user), follow_redirects=False)


def audit(db_url: str, action: str) -> list[AuditEntry]:
    with session_scope(db_url) as s:
        return list(s.scalars(select(AuditEntry).where(AuditEntry.action == action)))


def refused(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.text
    assert "ty_session" not in r.cookies


# --- the code flow -----------------------------------------------------------------------------


def test_sso_is_off_unless_configured(client: TestClient) -> None:
    assert client.get("/v1/ui/sso").json() == {"enabled": False, "name": None, "login_path": None}
    r = client.get("/v1/ui/sso/login", follow_redirects=False)
    assert r.status_code == 404 and r.json()["error"]["code"] == "sso_off"
    assert client.post("/v1/auth/device").status_code == 404


def test_the_code_flow_signs_the_dashboard_in(
    sso: TestClient, provider: OidcProvider, db_url: str, factory: Factory
) -> None:
    assert sso.get("/v1/ui/sso").json() == {
        "enabled": True, "name": "127.0.0.1", "login_path": "/v1/ui/sso/login"}  # fmt: skip
    url = start(sso, "/jobs/abc?x=1")
    q = parse_qs(urlsplit(url).query)
    assert url.startswith(provider.issuer + "/auth?")
    assert q["response_type"] == ["code"] and q["code_challenge_method"] == ["S256"]
    assert q["redirect_uri"] == [CALLBACK] and q["client_id"] == [CLIENT_ID]
    assert q["scope"] == ["openid profile email groups"]  # all supported by this provider
    assert {"state", "nonce", "code_challenge"} <= set(q)
    r = sso.get(at_provider(provider, url, "alice"), follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/jobs/abc?x=1"
    cookie = r.headers["set-cookie"]
    assert "ty_session=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert sso.get("/v1/jobs").status_code == 200  # the session works as a token does
    me = sso.get("/v1/ui/session").json()
    assert me["user"] == "alice" and me["csrf"]
    [entry] = audit(db_url, "auth.login")
    assert entry.user_name == "alice" and entry.details["via"] == "sso"
    with session_scope(db_url) as s:
        row = s.scalar(select(ApiToken).where(ApiToken.id == entry.details["token_id"]))
        assert row is not None and row.label == "sso" and row.revoked_at is None
    # tokens keep working beside it
    other = {"Authorization": f"Bearer {factory.token('carol')}"}
    assert sso.get("/v1/jobs", headers=other).status_code == 200
    # logout ends the session and revokes the token made for it
    assert sso.delete("/v1/ui/session", headers={"X-CSRF-Token": me["csrf"]}).status_code == 204
    with session_scope(db_url) as s:
        assert s.get(ApiToken, row.id).revoked_at is not None  # type: ignore[union-attr]
    assert sso.get("/v1/jobs").status_code == 401
    assert len(audit(db_url, "auth.logout")) == 1


def test_revoking_the_sso_token_ends_the_session(
    sso: TestClient, provider: OidcProvider, db_url: str, admin: dict[str, str]
) -> None:
    assert sign_in(sso, provider, "alice").status_code == 303
    assert sso.get("/v1/jobs").status_code == 200
    [entry] = audit(db_url, "auth.login")
    r = sso.delete(f"/v1/tokens/{entry.details['token_id']}", headers=admin)
    assert r.status_code in (200, 204), r.text
    sso.cookies.delete("ty_sso")
    assert sso.get("/v1/jobs").status_code == 401


def test_an_ended_sessions_token_is_revoked_at_the_next_sign_in(
    sso: TestClient, provider: OidcProvider, db_url: str
) -> None:
    assert sign_in(sso, provider, "alice").status_code == 303
    [first] = audit(db_url, "auth.login")
    with session_scope(db_url) as s:  # the session ran out (12 hours later)
        s.execute(update(UiSession).values(expires_at=utcnow() - timedelta(seconds=1)))
    sso.cookies.clear()
    assert sign_in(sso, provider, "alice").status_code == 303
    with session_scope(db_url) as s:
        labels = {t.id: (t.label, t.revoked_at is not None) for t in s.scalars(select(ApiToken))}
    assert labels[first.details["token_id"]] == ("sso", True)
    assert sorted(labels.values()) == [("sso", False), ("sso", True)]


def test_next_is_only_ever_a_dashboard_path(sso: TestClient, provider: OidcProvider) -> None:
    for asked in ("//evil.test/x", "/\\evil.test", "https://evil.test/", "/v1/jobs"):
        r = sso.get(at_provider(provider, start(sso, asked), "alice"), follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/", asked
        sso.cookies.clear()


def test_sign_in_starts_are_bounded_per_address(
    settings: Settings, provider: OidcProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sso_routes.LIMITS, "login", 2)
    monkeypatch.setitem(sso_routes.LIMITS, "device", 1)
    with TestClient(create_app(sso_settings(settings, provider))) as c:
        for _ in range(2):
            assert c.get("/v1/ui/sso/login", follow_redirects=False).status_code == 302
        r = c.get("/v1/ui/sso/login", follow_redirects=False)
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
        assert c.post("/v1/auth/device").status_code == 200
        assert c.post("/v1/auth/device").status_code == 429


def test_a_replayed_absent_or_foreign_state_logs_nobody_in(
    sso: TestClient, provider: OidcProvider, db_url: str
) -> None:
    back = at_provider(provider, start(sso), "alice")
    # another browser (no ty_sso cookie) cannot use it
    with TestClient(sso.app) as stranger:
        refused(stranger.get(back, follow_redirects=False), 400, "another browser")
    assert sso.get(back, follow_redirects=False).status_code == 303
    sso.cookies.clear()
    replay = sso.get(back, follow_redirects=False)
    refused(replay, 400, "already used")
    assert replay.json()["error"]["code"] == "sso_state"
    refused(sso.get("/v1/ui/sso/callback?code=x", follow_redirects=False), 400, "unknown")
    refused(sso.get("/v1/ui/sso/callback?code=x&state=nope", follow_redirects=False), 400, "unknown")  # fmt: skip
    page = sso.get("/v1/ui/sso/callback?state=nope", headers={"Accept": "text/html"})
    assert (
        page.status_code == 400 and "Sign-in failed" in page.text and 'href="/login"' in page.text
    )
    assert len(audit(db_url, "auth.login")) == 1


def test_an_expired_id_token_is_refused(
    sso: TestClient, provider: OidcProvider, monkeypatch: pytest.MonkeyPatch, db_url: str
) -> None:
    back = at_provider(provider, start(sso), "alice")
    real = oidc.now
    monkeypatch.setattr(oidc, "now", lambda: real() + 2 * 3600)  # the token lives an hour
    r = sso.get(back, follow_redirects=False)
    refused(r, 401, "expired")
    assert audit(db_url, "auth.login") == []


def test_a_wrong_issuer_is_refused(settings: Settings, provider: OidcProvider, db_url: str) -> None:
    # The configured issuer reaches the provider, whose discovery names another issuer.
    elsewhere = provider.issuer.replace("127.0.0.1", "localhost")
    with TestClient(create_app(sso_settings(settings, provider, oidc_issuer=elsewhere))) as c:
        r = c.get("/v1/ui/sso/login", follow_redirects=False)
        refused(r, 503, "names the issuer")
        assert c.post("/v1/auth/device").status_code == 503
    with TestClient(create_app(sso_settings(settings, provider))) as c:
        # An answer that says it comes from another issuer (RFC 9207).
        back = urlsplit(at_provider(provider, start(c), "alice"))
        q = {k: v[0] for k, v in parse_qs(back.query).items()} | {"iss": "http://evil.test"}
        refused(c.get(urlunsplit(back._replace(query=urlencode(q))), follow_redirects=False),
                400, "not ours")  # fmt: skip
        # An ID token whose `iss` is not the provider's (as discovered).
        back2 = at_provider(provider, start(c), "alice")
        client = c.app.state.sso.client  # type: ignore[attr-defined]
        client._meta = (client._meta[0], dataclasses.replace(client._meta[1], issuer="http://evil.test"))  # fmt: skip
        refused(c.get(back2, follow_redirects=False), 401, "iss")
    assert audit(db_url, "auth.login") == []


def test_a_token_for_another_audience_is_refused(sso: TestClient, provider: OidcProvider) -> None:
    """An ID token the provider issued to another application is refused by our checks;
    the same checks take one issued to us."""
    sso.get("/v1/ui/sso")  # makes the process's client
    client = sso.app.state.sso.client  # type: ignore[attr-defined]
    theirs = provider.tokens_for(OTHER_ID, OTHER_SECRET, CALLBACK, "alice")
    ours = provider.tokens_for(CLIENT_ID, CLIENT_SECRET, CALLBACK, "alice")
    with pytest.raises(OidcError, match="aud"):
        asyncio.run(client.verify_id_token(theirs["id_token"], theirs["nonce"], None))
    claims = asyncio.run(client.verify_id_token(ours["id_token"], ours["nonce"], None))
    assert claims["aud"] == CLIENT_ID and claims["sub"] == "sub-alice"
    with pytest.raises(OidcError, match="nonce"):
        asyncio.run(client.verify_id_token(ours["id_token"], "another-nonce", None))
    forged = ours["id_token"][:-4] + ("AAAA" if not ours["id_token"].endswith("AAAA") else "BBBB")
    with pytest.raises(OidcError, match=r"refused|malformed"):
        asyncio.run(client.verify_id_token(forged, ours["nonce"], None))


def test_keys_are_fetched_again_for_an_unknown_key_id(
    sso: TestClient, provider: OidcProvider
) -> None:
    from joserfc.jwk import KeySet, RSAKey

    sso.get("/v1/ui/sso")
    client = sso.app.state.sso.client  # type: ignore[attr-defined]
    ours = provider.tokens_for(CLIENT_ID, CLIENT_SECRET, CALLBACK, "alice")
    stale = KeySet([RSAKey.generate_key(2048, parameters={"kid": "rotated-away"})])
    client._keys = (0.0, stale)  # as if cached before the provider rotated its keys
    claims = asyncio.run(client.verify_id_token(ours["id_token"], ours["nonce"], None))
    assert claims["sub"] == "sub-alice" and client._keys[1] is not stale
    client._keys = (time.monotonic() + 30, stale)  # refetched just now: not again at once
    with pytest.raises(OidcError, match="refused"):
        asyncio.run(client.verify_id_token(ours["id_token"], ours["nonce"], None))


def test_a_user_removed_at_the_provider_cannot_sign_in(
    sso: TestClient, provider: OidcProvider, db_url: str
) -> None:
    users = dict(USERS)
    del users["alice"]
    provider.set_users(users)
    r = sso.get(at_provider(provider, start(sso), "alice"), follow_redirects=False)
    refused(r, 403, "no such user at the provider")
    # removed between signing in at the provider and coming back: the code is refused
    provider.set_users(dict(USERS))
    back = at_provider(provider, start(sso), "alice")
    provider.set_users(users)
    refused(sso.get(back, follow_redirects=False), 401, "invalid_grant")
    # the user who cancels at the provider
    refused(sso.get(at_provider(provider, start(sso), "bob", abort=True), follow_redirects=False),
            403, "cancelled")  # fmt: skip
    assert audit(db_url, "auth.login") == []


def test_an_existing_user_signs_in_once_an_admin_links_the_account(
    sso: TestClient, provider: OidcProvider, factory: Factory, db_url: str, admin: dict[str, str]
) -> None:
    factory.token("bob")  # a user made with a token: never taken over by name
    refused(sign_in(sso, provider, "bob"), 403, "torchyard user link bob sub-bob")
    link = sso.put("/v1/users/bob/identity", json={"subject": "sub-bob"}, headers=admin)
    assert link.status_code == 200, link.text
    assert link.json() == {"user": "bob", "issuer": provider.issuer, "subject": "sub-bob"}
    assert sign_in(sso, provider, "bob").status_code == 303
    assert sso.get("/v1/ui/session").json()["user"] == "bob"
    sso.cookies.clear()
    provider.set_users({**USERS, "bob": {"sub": "sub-impostor", "groups": []}})
    refused(sign_in(sso, provider, "bob"), 403, "is linked to another sign-in account")
    # the bound account signs in as bob even under a new name at the provider
    provider.set_users({**USERS, "robert": {"sub": "sub-bob", "groups": []}})
    sso.cookies.clear()
    assert sign_in(sso, provider, "robert").status_code == 303
    assert sso.get("/v1/ui/session").json()["user"] == "bob"
    # an account linked to one user is not linked to another; a user's link is replaced
    factory.token("carol")
    taken = sso.put("/v1/users/carol/identity", json={"subject": "sub-bob"}, headers=admin)
    assert taken.status_code == 409 and "'bob'" in taken.json()["error"]["message"]
    again = sso.put("/v1/users/bob/identity", json={"subject": "sub-bob-2"}, headers=admin)
    assert again.status_code == 200
    assert [e.details["before"] for e in audit(db_url, "user.link")] == [None, "sub-bob"]
    me = {"Authorization": f"Bearer {factory.token('dave')}"}
    assert sso.put("/v1/users/bob/identity", json={"subject": "x"}, headers=me).status_code == 403


def test_groups_give_and_take_admin_and_project_roles(
    sso: TestClient, provider: OidcProvider, db_url: str
) -> None:
    with session_scope(db_url) as s:
        owner = get_or_create_user(s, "founder")
        create_project(s, "lab", owner.id)
    assert sign_in(sso, provider, "boss").status_code == 303
    assert sso.get("/v1/ui/session").json()["is_admin"] is True
    sso.cookies.clear()
    assert sign_in(sso, provider, "alice").status_code == 303

    def roles() -> dict[str, Any]:
        with session_scope(db_url) as s:
            p = project_named(s, "lab")
            assert p is not None
            found = {}
            for name in ("alice", "boss"):
                u = s.scalar(select(User).where(User.name == name))
                assert u is not None
                found[name] = (role_of(s, u.id, p.id), u.is_admin)
            return found

    assert roles() == {"alice": ("member", False), "boss": ("owner", True)}
    # the provider takes alice out of ml-team and boss out of admins and ml-leads
    provider.set_users({**USERS, "alice": {"sub": "sub-alice", "groups": []},
                        "boss": {"sub": "sub-boss", "groups": []}})  # fmt: skip
    with session_scope(db_url) as s:  # …while an owner made boss an owner by hand too
        p = project_named(s, "lab")
        boss = s.scalar(select(User).where(User.name == "boss"))
        assert p is not None and boss is not None
        set_member(s, p, boss, "owner")  # the same role: still the groups'
    for user in ("alice", "boss"):
        sso.cookies.clear()
        assert sign_in(sso, provider, user).status_code == 303
    assert roles() == {"alice": (None, False), "boss": (None, False)}
    sets = [e.details for e in audit(db_url, "project.member.remove")]
    assert {d["user"] for d in sets} == {"alice", "boss"} and all(d["via"] == "sso" for d in sets)
    assert [e.details for e in audit(db_url, "user.grant")] == [
        {"admin": True, "via": "sso"}, {"admin": False, "via": "sso"}]  # fmt: skip


def test_a_role_changed_by_hand_is_left_alone(
    sso: TestClient, provider: OidcProvider, db_url: str
) -> None:
    with session_scope(db_url) as s:
        create_project(s, "lab", get_or_create_user(s, "founder").id)
    assert sign_in(sso, provider, "alice").status_code == 303
    with session_scope(db_url) as s:
        p, alice = project_named(s, "lab"), s.scalar(select(User).where(User.name == "alice"))
        assert p is not None and alice is not None
        set_member(s, p, alice, "owner")  # raised by hand
    provider.set_users({**USERS, "alice": {"sub": "sub-alice", "groups": []}})
    sso.cookies.clear()
    assert sign_in(sso, provider, "alice").status_code == 303
    with session_scope(db_url) as s:
        p, alice = project_named(s, "lab"), s.scalar(select(User).where(User.name == "alice"))
        assert p is not None and alice is not None
        assert role_of(s, alice.id, p.id) == "owner"


def test_a_provider_that_is_down_fails_sign_in_clearly(
    settings: Settings, factory: Factory
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = settings.model_copy(update={"oidc_issuer": f"http://127.0.0.1:{port}",
                                       "oidc_client_id": "x", "oidc_client_secret": "y"})  # fmt: skip
    with TestClient(create_app(down)) as c:
        r = c.get("/v1/ui/sso/login", follow_redirects=False)
        refused(r, 503, "cannot be reached")
        assert r.json()["error"]["code"] == "sso_unavailable"
        assert c.post("/v1/auth/device").status_code == 503
        ok = {"Authorization": f"Bearer {factory.token('carol')}"}
        assert c.get("/v1/jobs", headers=ok).status_code == 200  # tokens work on


# --- the device flow (its API; the CLI's own tests are in tests/client) -----------------------


def test_the_device_flow_issues_an_ordinary_token(
    sso: TestClient, provider: OidcProvider, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 0.3)
    start_ = sso.post("/v1/auth/device").json()
    assert set(start_) == {"device_code", "user_code", "verification_uri",
                           "verification_uri_complete", "interval", "expires_in"}  # fmt: skip
    assert start_["interval"] >= 0.3 and start_["verification_uri"].startswith(provider.issuer)
    poll = {"device_code": start_["device_code"]}
    r = sso.post("/v1/auth/device/token", json=poll)
    assert r.status_code == 400 and r.json()["error"]["code"] == "authorization_pending"
    r = sso.post("/v1/auth/device/token", json=poll)  # at once: too soon
    assert r.status_code == 400 and r.json()["error"]["code"] == "slow_down"
    assert "Success" in provider.approve_device(start_["verification_uri_complete"], "boss")
    time.sleep(0.35)
    r = sso.post("/v1/auth/device/token", json=poll)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["user"] == "boss" and got["token"].startswith("ty_")
    headers = {"Authorization": f"Bearer {got['token']}"}
    assert sso.get("/v1/jobs", headers=headers).status_code == 200
    tokens = sso.get("/v1/tokens", headers=headers).json()["items"]
    mine = [t for t in tokens if t["id"] == got["token_id"]]
    assert mine and mine[0]["label"] == "sso-cli"
    [entry] = audit(db_url, "auth.login")
    assert entry.details == {"via": "sso", "flow": "device", "token_id": got["token_id"]}
    time.sleep(0.35)
    again = sso.post("/v1/auth/device/token", json=poll)  # a device code is good once
    assert again.status_code in (400, 403) and "token" not in again.json()


def test_a_denied_device_sign_in_is_access_denied(
    sso: TestClient, provider: OidcProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 0.0)
    start_ = sso.post("/v1/auth/device").json()
    provider.approve_device(start_["verification_uri_complete"], "alice", abort=True)
    r = sso.post("/v1/auth/device/token", json={"device_code": start_["device_code"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "access_denied"
    # a user removed at the provider after confirming: the provider refuses the grant
    start_ = sso.post("/v1/auth/device").json()
    provider.approve_device(start_["verification_uri_complete"], "alice")
    provider.set_users({k: v for k, v in USERS.items() if k != "alice"})
    r = sso.post("/v1/auth/device/token", json={"device_code": start_["device_code"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "sso_refused", r.text
    r = sso.post("/v1/auth/device/token", json={"device_code": "made-up"})
    assert r.status_code == 403 and "invalid_grant" in r.json()["error"]["message"]
