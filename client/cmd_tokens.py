"""The token commands, over the API: `token list` (your tokens; an admin's shows everyone's),
`token create --user NAME` (admins; prints only the secret, so `T=$(torchyard token create
--user bob)` works), `token revoke ID` (your own, or anyone's for an admin).

The first admin's token comes from the server's own database instead (`torchyard token
create --local --user NAME --admin`, store/cli.py), before any token exists to call the API
with; `torchyard up` makes it by itself."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, EXIT_USAGE, age, err, note, print_json, show
from torchyard.client.sdk import Client

LOCAL_HELP = (
    "--local: write the token straight into the server's database (TORCHYARD_DATABASE_URL) "
    "instead of asking the API; only for the first admin, before any token exists "
    "(`torchyard up` makes that one itself)"
)


def add_token_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """token list, create and revoke (the connection options on the innermost parser)."""
    token = sub.add_parser(
        "token",
        help="API tokens: list, create (admins), revoke",
        description="API tokens over the API. " + LOCAL_HELP,
    )
    actions = token.add_subparsers(dest="token_command", required=True, metavar="action")

    def action(name: str, fn: Callable[[Client, argparse.Namespace], int], help: str) -> Any:
        sp = actions.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        return sp

    sp = action("list", cmd_token_list, "your live tokens (an admin: everyone's); never a secret")
    sp.add_argument("--json", action="store_true", help="print the tokens as JSON")
    sp = action(
        "create",
        cmd_token_create,
        "make a token for a user, created if missing (admins); prints only the secret, once",
    )
    sp.add_argument("--user", required=True, help="the token's owner")
    sp.add_argument("--label", help="a name to tell the token apart by (e.g. laptop, ci)")
    sp.add_argument("--admin", action="store_true", help="make the user an admin")
    sp.add_argument(
        "--can-run-code",
        action="store_true",
        help="the user's jobs may run their own code (bundles, scripts, factories)",
    )
    sp.add_argument("--local", action="store_true", help=LOCAL_HELP)
    sp.add_argument("--json", action="store_true", help="print the new token as JSON")
    sp = action("revoke", cmd_token_revoke, "revoke a token by id: refused from then on")
    sp.add_argument("id", type=_token_id, help="the token's id (`torchyard token list`)")


def _token_id(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) < 2**31:
        raise argparse.ArgumentTypeError(f"not a token id (a whole number): {value!r}")
    return int(value)


def cmd_token_list(client: Client, args: argparse.Namespace) -> int:
    tokens = client.tokens()
    if args.json:
        print_json(tokens)
        return EXIT_OK
    if not tokens:
        print("no live tokens")
        return EXIT_OK
    rows = [
        (t.get("id"), t.get("user"), t.get("label") or "-", (t.get("prefix") or "") + "…",
         age(t.get("created_at")))
        for t in tokens
    ]  # fmt: skip
    show(render.table(["ID", "USER", "LABEL", "TOKEN", "CREATED"], rows))
    return EXIT_OK


def cmd_token_create(client: Client, args: argparse.Namespace) -> int:
    if args.local:  # `torchyard token … --local` never reaches here (torchyard/cli.py)
        err("--local is run by the `torchyard` command on the server, not over the API")
        return EXIT_USAGE
    made = client.create_token(
        args.user, label=args.label, admin=args.admin, can_run_code=args.can_run_code
    )
    if args.json:
        print_json(made)
        return EXIT_OK
    # Only the secret on stdout; what it is goes to stderr.
    print(made["token"])
    note(f"token {made['id']} for {made['user']}: shown this once, keep it secret")
    return EXIT_OK


def cmd_token_revoke(client: Client, args: argparse.Namespace) -> int:
    client.revoke_token(args.id)
    note(f"token {args.id} revoked")
    return EXIT_OK
