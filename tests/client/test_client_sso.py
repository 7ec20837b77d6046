"""`torchyard login URL --sso`: the device authorization grant (RFC 8628) against a real
OpenID provider (tests/oidc_provider.py), the user's confirmation at the provider made by
the "browser" the CLI opens (BROWSER, as `torchyard ui` honours it). The saved token is an
ordinary one: it works, and `torchyard token revoke` ends it."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import threading
import time
import webbrowser
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from oidc_provider import CLIENT_ID, CLIENT_SECRET, USERS, OidcProvider, start_provider
from support.liveserver import live_server

from torchyard.api.app import create_app
from torchyard.api.routers import sso as sso_routes
from torchyard.client import cmd_login, config
from torchyard.client.cli import main
from torchyard.client.errors import APIError
from torchyard.client.sdk import Client
from torchyard.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    with start_provider(tmp_path_factory.mktemp("oidc"), ["http://testserver/v1/ui/sso/callback"]) as op:  # fmt: skip
        yield op


@pytest.fixture
def sso_settings(settings: Settings, provider: OidcProvider) -> Settings:
    provider.set_users(dict(USERS))
    return settings.model_copy(update={"oidc_issuer": provider.issuer,
                                       "oidc_client_id": CLIENT_ID,
                                       "oidc_client_secret": CLIENT_SECRET})  # fmt: skip


@pytest.fixture
def sso_http(sso_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(sso_settings)) as c:
        yield c


def target_of(uri: str) -> str:
    """The URL a private redirect page (client/ui_cmd.py: redirect_page) leads to."""
    page = Path(urlsplit(uri).path).read_text()
    found = re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', page)
    assert found, page
    return html.unescape(found.group(1))


def fake_browser(monkeypatch: pytest.MonkeyPatch, then: Callable[[str], Any]) -> list[str]:
    """webbrowser.open replaced by a browser that hands the page's target to `then` (in a
    thread, a moment later: the CLI is polling by then). Returns the URLs opened."""
    opened: list[str] = []

    def open_(uri: str, *a: Any, **kw: Any) -> bool:
        opened.append(target_of(uri))
        threading.Timer(0.3, then, (opened[-1],)).start()
        return True

    monkeypatch.setenv("BROWSER", "a-browser")
    monkeypatch.setattr(webbrowser, "open", open_)
    return opened


def polls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each poll of the CLI got: the error code, or "token"."""
    seen: list[str] = []
    real = Client.device_token

    def spy(self: Client, device_code: str) -> dict:
        try:
            got = real(self, device_code)
        except APIError as e:
            seen.append(e.code)
            raise
        seen.append("token")
        return got

    monkeypatch.setattr(Client, "device_token", spy)
    return seen


def test_login_sso_saves_a_token_that_works_and_can_be_revoked(
    sso_http: TestClient,
    provider: OidcProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 0.25)
    seen = polls(monkeypatch)
    opened = fake_browser(monkeypatch, lambda url: provider.approve_device(url, "alice"))
    assert main(["login", "http://testserver", "--sso"], http=sso_http) == 0
    out = capsys.readouterr().out
    code = re.search(r"Open (\S+) and confirm code (\S+)", out)
    assert code and opened == [code.group(1)] and code.group(2) in code.group(1)
    assert "as alice by single sign-on" in out
    assert seen[0] == "authorization_pending" and seen[-1] == "token"
    saved = config.load()
    assert saved is not None and saved.url == "http://testserver" and saved.saved_by == "login"
    auth = {"Authorization": f"Bearer {saved.token}"}
    assert sso_http.get("/v1/jobs", headers=auth).status_code == 200
    [mine] = [
        t
        for t in sso_http.get("/v1/tokens", headers=auth).json()["items"]
        if t["label"] == "sso-cli"
    ]
    # every later command uses the saved login; revoking the token ends it
    assert main(["token", "revoke", str(mine["id"])], http=sso_http) == 0
    assert sso_http.get("/v1/jobs", headers=auth).status_code == 401


def test_login_sso_backs_off_on_slow_down(
    sso_http: TestClient,
    provider: OidcProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The server announces 0.2 s, then enforces 2 s: the client's next poll (~0.2 s later,
    # however loaded the machine) is told slow_down, and its interval from then on (0.2 +
    # 2.5 s) is past what is enforced. (0.5 s enforced against 0.2 + 0.6 s: a loaded run
    # polled slower than 0.5 s and was never told slow_down.)
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 0.2)  # what the server announces…
    monkeypatch.setattr(cmd_login, "SLOW_DOWN_S", 2.5)

    def approve_later(url: str) -> None:
        provider.approve_device(url, "bob")

    seen = polls(monkeypatch)
    fake_browser(monkeypatch, approve_later)
    real_open = webbrowser.open

    def open_and_tighten(uri: str, *a: Any, **kw: Any) -> bool:
        monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 2.0)  # …then enforces
        return real_open(uri)

    monkeypatch.setattr(webbrowser, "open", open_and_tighten)
    assert main(["login", "http://testserver", "--sso"], http=sso_http) == 0
    assert "slow_down" in seen and seen[-1] == "token", seen
    after = seen[seen.index("slow_down") + 1 :]
    assert "slow_down" not in after  # the longer interval is kept
    assert "as bob by single sign-on" in capsys.readouterr().out


def test_a_denied_login_sso_fails_and_saves_nothing(
    sso_http: TestClient,
    provider: OidcProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    _own_login_file: Path,
) -> None:
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 0.25)
    fake_browser(monkeypatch, lambda url: provider.approve_device(url, "alice", abort=True))
    assert main(["login", "http://testserver", "--sso"], http=sso_http) == 1
    err = capsys.readouterr().err
    assert "the sign-in was denied at the provider; nothing was saved" in err
    assert not _own_login_file.exists()
    assert main(["login", "http://testserver", "--sso", "--token", "ty_x"], http=sso_http) == 2


def test_login_sso_without_sso_on_the_server_says_so(
    http: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["login", "http://testserver", "--sso"], http=http) == 1
    assert "no single sign-on at http://testserver: single sign-on is not configured" in (
        capsys.readouterr().err
    )


BROWSER_SCRIPT = """import html, re, sys, pathlib, urllib.parse
page = pathlib.Path(urllib.parse.urlsplit(sys.argv[1]).path).read_text()
url = html.unescape(re.search(r'content="0;url=([^"]+)"', page).group(1))
pathlib.Path(sys.argv[2]).write_text(url)
"""


def test_login_sso_as_a_process_opens_browser_and_saves_the_login(
    sso_settings: Settings,
    provider: OidcProvider,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    _own_login_file: Path,
) -> None:
    """The real command in its own process against a served API, opening the URL with
    the browser BROWSER names (a script that notes it; the test confirms the code)."""
    monkeypatch.setattr(sso_routes, "DEVICE_INTERVAL_S", 1.0)
    (tmp_path / "browser.py").write_text(BROWSER_SCRIPT)
    noted = tmp_path / "opened.txt"
    env_browser = f"{sys.executable} {tmp_path / 'browser.py'} %s {noted}"
    monkeypatch.setenv("BROWSER", env_browser)
    with live_server(create_app(sso_settings)) as port:
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "torchyard", "login", url, "--sso"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while not noted.exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        provider.approve_device(noted.read_text(), "alice")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"Open {noted.read_text()} and confirm code" in out
    saved = json.loads(_own_login_file.read_text())
    assert saved["url"] == url and saved["token"].startswith("ty_")
    assert oct(_own_login_file.stat().st_mode & 0o777) == "0o600"
