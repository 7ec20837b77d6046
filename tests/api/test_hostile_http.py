"""Hostile tenants, issue 25: the login cookie is `Secure` behind a TLS proxy (and only a
configured proxy's word counts), `/docs` loads no third-party script unless an operator
turns it on, and every HTML answer carries a Content-Security-Policy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.responses import HTMLResponse
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.app import create_app
from torchyard.api.routers.ui import CSP
from torchyard.settings import Settings

pytestmark = pytest.mark.hostile

HTTPS = {"X-Forwarded-Proto": "https"}


def _client(settings: Settings, peer: str, **update: Any) -> Iterator[TestClient]:
    app = create_app(settings.model_copy(update=update))
    with TestClient(app, client=(peer, 40000)) as c:
        yield c


def _login_cookie(c: TestClient, token: str, headers: dict[str, str]) -> str:
    r = c.post("/v1/ui/sessions", json={}, headers={"Authorization": f"Bearer {token}", **headers})
    assert r.status_code == 201, r.text
    return r.headers["set-cookie"].lower()


def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(
    settings: Settings, factory: Factory
) -> None:
    token = factory.token("alice")
    for c in _client(settings, "10.1.2.3", trusted_proxies="10.1.0.0/16, 192.0.2.7"):
        assert "; secure" in _login_cookie(c, token, HTTPS)
        assert "; secure" not in _login_cookie(c, token, {})  # the proxy says plain http
        # The proxy appends what it saw: a client's own "https" before it is not believed.
        assert "; secure" not in _login_cookie(c, token, {"X-Forwarded-Proto": "https, http"})


def test_only_configured_proxies_are_believed(settings: Settings, factory: Factory) -> None:
    token = factory.token("alice")
    for c in _client(settings, "10.1.2.3"):  # no proxies configured: the header is ignored
        assert "; secure" not in _login_cookie(c, token, HTTPS)
    for c in _client(settings, "203.0.113.9", trusted_proxies="10.1.0.0/16"):
        assert "; secure" not in _login_cookie(c, token, HTTPS)


def test_a_bad_proxy_setting_names_the_variable(settings: Settings) -> None:
    with pytest.raises(ValueError, match="TORCHYARD_TRUSTED_PROXIES: 'nope'"):
        Settings(_env_file=None, home=settings.home, trusted_proxies="10.0.0.1, nope")  # type: ignore[call-arg]


def test_docs_load_no_third_party_script_by_default(client: TestClient) -> None:
    for path in ("/docs", "/redoc"):
        r = client.get(path)
        assert r.status_code == 404 and "<script" not in r.text
    assert client.get("/openapi.json").json()["info"]["title"] == "torchyard"


def test_docs_turned_on_get_a_csp_naming_only_their_sources(settings: Settings) -> None:
    for c in _client(settings, "127.0.0.1", api_docs=True):
        r = c.get("/docs")
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        script_src = csp.split("script-src ")[1].split(";")[0]
        assert "'unsafe-inline'" not in script_src and "*" not in script_src
        assert "'sha256-" in script_src  # its one inline script, by hash
        assert "frame-ancestors 'none'" in csp and r.headers["x-frame-options"] == "DENY"


def test_every_html_answer_gets_the_dashboards_csp(settings: Settings) -> None:
    app = create_app(settings)

    @app.get("/plain-page")
    def plain() -> HTMLResponse:
        return HTMLResponse("<!doctype html><p>hello")

    with TestClient(app) as c:
        r = c.get("/plain-page")
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        page = c.get("/")  # the dashboard keeps its own headers, not doubled
        assert page.headers.get_list("content-security-policy") == [CSP]
        assert "content-security-policy" not in c.get("/healthz").headers
