"""Administration commands: `torchyard db upgrade` and `torchyard token create`."""

from __future__ import annotations

import argparse
import sys

from torchyard.settings import get_settings


def db_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchyard db", description="database administration")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser(
        "upgrade", help="migrate the database (TORCHYARD_DATABASE_URL) to the newest schema"
    )
    sub.add_parser("current", help="print the schema revision the database is at")
    args = parser.parse_args(argv)

    from torchyard.store import migrate

    url = get_settings().db_url
    if args.action == "upgrade":
        migrate.upgrade(url)
        print(f"database at revision {migrate.current(url)}", file=sys.stderr)
    else:
        print(migrate.current(url) or "none")
    return 0


def token_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchyard token", description="API tokens")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a token (and the user if new); prints the token")
    create.add_argument("--user", required=True, help="user name (created if missing)")
    create.add_argument("--admin", action="store_true", help="the user sees every job")
    create.add_argument(
        "--can-run-code",
        action="store_true",
        help="jobs of this user may run their own code: bundles, scripts, module:function "
        "factories; that code runs with the worker's privileges",
    )
    args = parser.parse_args(argv)

    from torchyard.store.auth import create_token
    from torchyard.store.db import session_scope

    if not 1 <= len(args.user) <= 100:
        parser.error("--user must be 1 to 100 characters")
    with session_scope(get_settings().db_url) as session:
        token = create_token(session, args.user, admin=args.admin, can_run_code=args.can_run_code)
    # Only the token on stdout, so `TOKEN=$(torchyard token create --user me)` works.
    print(token)
    return 0
