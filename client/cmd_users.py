"""The user commands (admins), over the API: `user set NAME [--admin|--no-admin]
[--code|--no-code]` gives or takes back a permission, for every token of the user at once;
`user link NAME SUBJECT` links a user to their single sign-on account (the subject a
refused first sign-in names)."""

from __future__ import annotations

import argparse
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import (
    EXIT_OK,
    EXIT_USAGE,
    command_group,
    err,
    note,
    print_json,
    show,
)
from torchyard.client.sdk import Client


def add_user_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """user set and user link (the connection options on the innermost parser)."""
    action = command_group(
        sub,
        common,
        "user",
        "users' permissions and single sign-on links (admins)",
        "Users over the API (admins). A user is made by `torchyard token create --user NAME` "
        "or by a first single sign-on.",
    )
    sp = action(
        "set",
        cmd_user_set,
        "give or take back a user's permissions: they hold for every token and session of "
        "the user from the next request on",
    )
    sp.add_argument("name", help="the user (`me`: yourself)")
    sp.add_argument(
        "--admin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="make the user an admin, or (--no-admin) no longer one; the last admin stays one",
    )
    sp.add_argument(
        "--code",
        dest="can_run_code",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the user's jobs may (or, --no-code, may not) run their own code",
    )
    sp.add_argument("--json", action="store_true", help="print the answer as JSON")
    sp = action(
        "link",
        cmd_user_link,
        "link a user to their account at the single sign-on provider; that account then "
        "signs in as the user",
    )
    sp.add_argument("name", help="the user")
    sp.add_argument("subject", help="the account's subject (`sub`), as a refused sign-in names it")


def cmd_user_set(client: Client, args: argparse.Namespace) -> int:
    if args.admin is None and args.can_run_code is None:
        err("nothing to set: give --admin/--no-admin and/or --code/--no-code")
        return EXIT_USAGE
    got = client.set_user(args.name, admin=args.admin, can_run_code=args.can_run_code)
    if args.json:
        print_json(got)
        return EXIT_OK
    yes = {True: "yes", False: "no"}
    rows = [("user", got["user"]), ("admin", yes[got["admin"]]),
            ("can_run_code", yes[got["can_run_code"]])]  # fmt: skip
    show(render.fields(rows))
    return EXIT_OK


def cmd_user_link(client: Client, args: argparse.Namespace) -> int:
    got = client.link_user(args.name, args.subject)
    note(f"{got['subject']!r} at {got['issuer']} now signs in as {got['user']}")
    return EXIT_OK
