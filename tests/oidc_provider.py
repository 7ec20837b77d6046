"""A real OpenID provider for the single sign-on tests: tests/oidc/provider.mjs, which runs
node-oidc-provider (OpenID Certified) as tests/oidc/package-lock.json pins it, installed
by `npm ci` from the repository's own files when missing or stale. Where Node is missing
the tests are skipped, except under CI=true, where they fail loudly instead.

`start_provider` starts it on a free port with two confidential clients (torchyard's and
another application's, for the wrong-audience test), PKCE required and the device flow on,
its users read from a JSON file on every request (`set_users`: a user removed there can no
longer sign in). `sign_in` and `approve_device` go through its pages as a person in a
browser would (forms posted, redirects followed), with httpx.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import pytest

HERE = Path(__file__).resolve().parent / "oidc"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CLIENT_ID, CLIENT_SECRET = "torchyard", "torchyard-test-secret-0123456789"
OTHER_ID, OTHER_SECRET = "other-app", "other-app-test-secret-0123456789"
USERS: dict[str, dict[str, Any]] = {
    "alice": {"sub": "sub-alice", "groups": ["ml-team"]},
    "bob": {"sub": "sub-bob", "groups": []},
    "boss": {"sub": "sub-boss", "groups": ["admins", "ml-leads"]},
}
_install_lock = threading.Lock()


def _unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"the single sign-on tests cannot run: {why} (CI requires them)", pytrace=False)
    pytest.skip(why)


def ensure_installed() -> None:
    """oidc-provider in tests/oidc/node_modules, as the lock file pins it (`npm ci` again
    only when the lock file changed)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _unavailable("node/npm missing: apt-get install nodejs npm")
    stamp = HERE / "node_modules" / ".torchyard-lock-sha256"
    want = hashlib.sha256((HERE / "package-lock.json").read_bytes()).hexdigest()
    with _install_lock:
        if stamp.is_file() and stamp.read_text().strip() == want:
            return
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=HERE, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            _unavailable(f"npm ci in {HERE} failed: {done.stderr[-2000:]}")
        stamp.write_text(want + "\n")


class _Forms(HTMLParser):
    """The forms of a page: (id, action, {hidden input: value})."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[tuple[str, str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append((a.get("id", ""), a.get("action", ""), {}))
        elif tag == "input" and self.forms and a.get("type") == "hidden":
            self.forms[-1][2][a.get("name", "")] = a.get("value", "")


def forms_of(page: str) -> list[tuple[str, str, dict[str, str]]]:
    parser = _Forms()
    parser.feed(page)
    return parser.forms


@dataclass
class OidcProvider:
    issuer: str
    port: int
    users_path: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    users: dict[str, dict[str, Any]] = field(default_factory=dict)

    def set_users(self, users: dict[str, dict[str, Any]]) -> None:
        """The provider's accounts from now on (written whole, then renamed)."""
        tmp = self.users_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(users))
        tmp.replace(self.users_path)
        self.users = users

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def _ours(self, url: str) -> bool:
        return urlsplit(url)[:2] == urlsplit(self.issuer)[:2]

    def sign_in(self, browser: httpx.Client, url: str, user: str, abort: bool = False) -> str:
        """Follow `url` through the provider's pages as `user` (or press Cancel): the URL
        the provider sends the browser to outside itself (the client's redirect URI)."""
        for _ in range(20):
            r = browser.get(url, follow_redirects=False)
            while r.is_redirect:
                url = urljoin(url, r.headers["location"])
                if not self._ours(url):
                    return url
                r = browser.get(url, follow_redirects=False)
            r.raise_for_status()
            action = "/abort" if abort else "/login"
            form = next(a for _, a, _ in forms_of(r.text) if a.endswith(action))
            data = {} if abort else {"login": user}
            r = browser.post(urljoin(url, form), data=data, follow_redirects=False)
            assert r.is_redirect, r.text
            url = urljoin(url, r.headers["location"])
            if not self._ours(url):
                return url
        raise AssertionError("the provider's pages went round in circles")

    def approve_device(self, uri: str, user: str, abort: bool = False) -> str:
        """Confirm a device sign-in at `uri` (verification_uri_complete) as `user`, or abort
        it: the provider's last page."""
        with httpx.Client(follow_redirects=True, timeout=20) as browser:
            r = browser.get(uri)
            _, action, fields = forms_of(r.text)[0]  # posts itself on load (script)
            r = browser.post(urljoin(str(r.url), action), data=fields)
            _, action, fields = next(f for f in forms_of(r.text) if f[0] == "op.deviceConfirmForm")  # fmt: skip
            data = {**fields, "abort": "yes"} if abort else fields
            r = browser.post(urljoin(str(r.url), action), data=data)
            if not abort and "/interaction/" in str(r.url):
                form = next(a for _, a, _ in forms_of(r.text) if a.endswith("/login"))
                r = browser.post(urljoin(str(r.url), form), data={"login": user})
            return r.text

    def tokens_for(self, client_id: str, secret: str, redirect_uri: str, user: str) -> dict[str, Any]:  # fmt: skip
        """A whole code flow as `client_id` (PKCE, a nonce): the token answer, with the
        nonce sent as `nonce`."""
        verifier, nonce = secrets.token_urlsafe(48), secrets.token_urlsafe(16)
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
        meta = httpx.get(self.issuer + "/.well-known/openid-configuration").json()
        query = {"response_type": "code", "client_id": client_id, "redirect_uri": redirect_uri,
                 "scope": "openid profile groups", "state": "s", "nonce": nonce,
                 "code_challenge": challenge.rstrip(b"=").decode(),
                 "code_challenge_method": "S256"}  # fmt: skip
        with httpx.Client(timeout=20) as browser:
            back = self.sign_in(browser, meta["authorization_endpoint"] + "?" + urlencode(query), user)  # fmt: skip
        code = parse_qs(urlsplit(back).query)["code"][0]
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "code_verifier": verifier}  # fmt: skip
        r = httpx.post(meta["token_endpoint"], data=form, auth=(client_id, secret))
        r.raise_for_status()
        return {**r.json(), "nonce": nonce}


def _wait_started(proc: subprocess.Popen[bytes], log_path: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"the OpenID provider did not start: {log_path.read_text()[-3000:]}")
    return dict(json.loads(line))


@contextlib.contextmanager
def start_provider(
    folder: Path,
    redirect_uris: list[str],
    users: dict[str, dict[str, Any]] | None = None,
    *,
    issuer: str = "http://127.0.0.1:{port}",
    host: str = "127.0.0.1",
) -> Iterator[OidcProvider]:
    """The provider until the block ends; `issuer`'s "{port}" becomes its port."""
    ensure_installed()
    folder.mkdir(parents=True, exist_ok=True)
    users_path, log_path = folder / "users.json", folder / "provider.log"
    users_path.write_text(json.dumps(users if users is not None else USERS))
    clients = [{"client_id": cid, "client_secret": sec, "redirect_uris": redirect_uris}
               for cid, sec in ((CLIENT_ID, CLIENT_SECRET), (OTHER_ID, OTHER_SECRET))]  # fmt: skip
    config = {"host": host, "port": 0, "issuer": issuer, "users": str(users_path), "clients": clients}  # fmt: skip
    (folder / "provider.json").write_text(json.dumps(config))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["node", str(HERE / "provider.mjs"), str(folder / "provider.json")],
            stdout=subprocess.PIPE, stderr=log, cwd=HERE,
        )  # fmt: skip
    try:
        started = _wait_started(proc, log_path)
        op = OidcProvider(started["issuer"], started["port"], users_path, proc, log_path,
                          dict(users if users is not None else USERS))  # fmt: skip
        deadline = time.monotonic() + 20
        while httpx.get(op.issuer + "/.well-known/openid-configuration").status_code != 200:
            assert time.monotonic() < deadline, op.log_tail()
            time.sleep(0.05)
        yield op
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
