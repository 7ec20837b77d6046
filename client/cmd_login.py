"""The login command: check a server's URL and token with one authenticated request and
save both (client/config.py) for every later command; the token is asked for, without echo,
when none is given and a person is at the terminal."""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

from torchyard.client import config
from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, err
from torchyard.client.errors import APIError, NotFound, TorchyardError
from torchyard.client.sdk import Client


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
    sp.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")


def cmd_login(client: Client, args: argparse.Namespace) -> int:
    """Check the URL and token with an authenticated request, then save both. Nothing is
    saved when either is wrong."""
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
