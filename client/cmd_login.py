"""The login command: check a server's URL and token with one authenticated request and
save both (client/config.py) for every later command; the token is asked for, without echo,
when none is given and a person is at the terminal.

`--sso` signs in at the server's OpenID provider instead, through the device authorization
grant (RFC 8628) that the server runs with its client secret: the user opens the URL shown
(opened for them where a browser is, honouring BROWSER, as `torchyard ui` does) and
confirms the code; meanwhile this polls at the interval the server gives (5 s more after
each `slow_down`) and saves the ordinary API token it gets (label `sso-cli`, revocable with
`torchyard token revoke`) where `login --token` saves one."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
import webbrowser
from typing import Any

from torchyard.client import config
from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, err
from torchyard.client.errors import APIError, NotFound, TorchyardError
from torchyard.client.sdk import Client
from torchyard.client.ui_cmd import _can_open, redirect_page

SLOW_DOWN_S = 5.0  # RFC 8628 §3.5: each slow_down adds 5 s to the interval


def add_login_command(sub: Any) -> None:
    what = (
        "check a server's URL and token and save them for every torchyard command, from any "
        f"directory: in {config.config_path()} (mode 0600)"
    )
    sp = sub.add_parser("login", help="save a server's URL and token", description=what)
    sp.set_defaults(run=cmd_login)
    sp.add_argument("url", help="the API's URL, e.g. http://gpu-host:8000")
    sp.add_argument(
        "--token",
        help="API token (`torchyard token create --user NAME` on the server makes one); "
        "default: $TORCHYARD_TOKEN, a token saved for this URL, else asked for",
    )
    sp.add_argument(
        "--sso",
        action="store_true",
        help="sign in at the server's single sign-on provider (a code to confirm in a "
        "browser) and save the API token it issues",
    )
    sp.add_argument("--no-open", action="store_true", help="with --sso: print the URL only")
    sp.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")


def cmd_login(client: Client, args: argparse.Namespace) -> int:
    """Check the URL and token with an authenticated request, then save both. Nothing is
    saved when either is wrong."""
    if args.sso:
        if args.token:
            err("give --sso or --token, not both")
            return EXIT_USAGE
        return _login_sso(client, args)
    if client.token is None:
        token = _ask_token(client.url)
        if not token:
            err(
                f"no token for {client.url}: give --token T or set TORCHYARD_TOKEN "
                "(`torchyard token create --user NAME` on the server makes one)"
            )
            return EXIT_USAGE
        client.use_token(token)
    try:
        user = client.get_quota("me").get("user")
    except NotFound:
        err(f"{client.url} answers, but not as a torchyard API (404 for /v1/users/me/quota)")
        return EXIT_FAIL
    except TorchyardError as e:
        err(f"{e.one_line() if isinstance(e, APIError) else e}; nothing was saved")
        return EXIT_FAIL
    assert client.token is not None
    path = config.save(client.url, client.token, saved_by="login")
    print(f"logged in to {client.url} as {user} (token from {client.connection.token_from})")
    print(f"saved the URL and token in {path} (mode 0600); every torchyard command uses them")
    print("from any directory unless --url/--token or TORCHYARD_URL/TORCHYARD_TOKEN are given")
    return EXIT_OK


def _ask_token(url: str) -> str | None:
    """The token, typed without echo, when a person is at the terminal."""
    if not sys.stdin.isatty():
        return None
    return getpass.getpass(f"token for {url}: ").strip() or None


def _login_sso(client: Client, args: argparse.Namespace) -> int:
    """The device sign-in: start it, show (and open) where to confirm, poll, save."""
    try:
        start = client.device_sign_in()
    except NotFound as e:
        err(f"no single sign-on at {client.url}: {e.message}; log in with --token instead")
        return EXIT_FAIL
    except TorchyardError as e:
        err(f"{e.one_line() if isinstance(e, APIError) else e}; nothing was saved")
        return EXIT_FAIL
    complete = start.get("verification_uri_complete")
    if complete:
        print(f"Open {complete} and confirm code {start['user_code']}", flush=True)
    else:
        print(f"Open {start['verification_uri']} and enter code {start['user_code']}", flush=True)
    if not args.no_open and _can_open(os.environ):
        _open(complete or start["verification_uri"])
    try:
        got = _poll(client, start)
    except TorchyardError as e:
        err(f"{e.one_line() if isinstance(e, APIError) else e}; nothing was saved")
        return EXIT_FAIL
    path = config.save(client.url, got["token"], saved_by="login")
    print(f"logged in to {client.url} as {got['user']} by single sign-on")
    print(f"saved the URL and a new API token (label sso-cli) in {path} (mode 0600);")
    print("`torchyard token list` shows it and `torchyard token revoke ID` ends it")
    return EXIT_OK


def _open(url: str) -> None:
    """The browser, given a private page that leads to `url` (never the URL itself on a
    command line every local user can read: client/ui_cmd.py)."""
    try:
        opened = webbrowser.open(redirect_page(url).as_uri())
    except (webbrowser.Error, OSError):
        opened = False
    if not opened:
        err("no browser to open: open the URL above")


def _poll(client: Client, start: dict[str, Any]) -> dict[str, Any]:
    """Poll until the user confirms: the token answer; TorchyardError when denied or
    expired."""
    interval = max(float(start.get("interval") or 5.0), 0.0)
    deadline = time.monotonic() + float(start.get("expires_in") or 600.0)
    while True:
        time.sleep(interval)
        try:
            return client.device_token(start["device_code"])
        except APIError as e:
            if e.code == "slow_down":
                interval += SLOW_DOWN_S
            elif e.code == "access_denied":
                raise TorchyardError("the sign-in was denied at the provider") from None
            elif e.code == "expired_token":
                raise TorchyardError(_EXPIRED) from None
            elif e.code != "authorization_pending":
                raise
        if time.monotonic() > deadline:
            raise TorchyardError(_EXPIRED)


_EXPIRED = "the code expired before it was confirmed: run `torchyard login URL --sso` again"
