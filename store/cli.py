"""Administration commands on the server's own database: `torchyard db upgrade` and the
first admin's token, `torchyard token create --local`.

Tokens are otherwise made, listed and revoked over the API (`torchyard token …`,
client/cmd_tokens.py, by an admin); the local path is for the first admin, before any
token exists (or to get back in when every admin token was revoked): whoever can write the
database can do anything anyway. Both commands make their files private to this user
(umask 077: a new SQLite database is not world-readable). A token made here is in the
audit trail as made by `<os user>@local` from `local`."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torchyard.settings import get_settings, private_umask

if TYPE_CHECKING:  # the store's modules are imported by the command that needs them
    from torchyard.store.audit import Actor

BOOTSTRAP = (
    "The first admin's token, written straight into the database (TORCHYARD_DATABASE_URL): "
    "for bootstrapping only, before any token exists to call the API with (`torchyard up` "
    "makes one itself). Every other token: `torchyard token create --user NAME` by an admin, "
    "over the API; list and revoke them with `torchyard token list|revoke`."
)


def db_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchyard db", description="database administration")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser(
        "upgrade", help="migrate the database (TORCHYARD_DATABASE_URL) to the newest schema"
    )
    sub.add_parser("current", help="print the schema revision the database is at")
    args = parser.parse_args(argv)

    from torchyard.store import migrate

    with _private():
        url = get_settings().db_url
        if args.action == "upgrade":
            _say_each_migration()
            migrate.upgrade(url)
            print(f"database at revision {migrate.current(url)}", file=sys.stderr)
        else:
            print(migrate.current(url) or "none")
    return 0


def _say_each_migration() -> None:
    """One line on stderr per migration this process ran (none when another upgrade had
    run them), for the operator and the logs: Alembic's `Running upgrade A -> B, …` with
    the migration's title in place of its docstring's whole first paragraph."""
    log = logging.getLogger("alembic.runtime.migration")
    log.setLevel(logging.INFO)
    if not any(getattr(h, "torchyard_migrations", False) for h in log.handlers):
        handler = _Stderr()
        handler.addFilter(_migration_line)
        handler.torchyard_migrations = True  # type: ignore[attr-defined]
        log.addHandler(handler)


class _Stderr(logging.Handler):
    """sys.stderr as it is at each record, not when the handler was added (a StreamHandler
    keeps the stream it was made with: a later command in this process, a test's, would
    write to one that is gone)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def _migration_line(record: logging.LogRecord) -> bool:
    """Keep only Alembic's `Running %s` records, each rewritten to one line."""
    if not str(record.msg).startswith("Running "):
        return False
    step = record.args[0] if isinstance(record.args, tuple) and record.args else None
    short = getattr(step, "short_log", None)  # "upgrade 0003 -> 0004"
    if short is not None:
        title = migration_title(getattr(step, "doc", None))
        record.msg, record.args = f"Running {short}" + (f", {title}" if title else ""), ()
    return True


def migration_title(doc: str | None) -> str:
    """A migration's title: its docstring's first line up to the colon that ends the
    heading (`Teams: projects and …` is `Teams`); a colon inside `…` or (…) is the title's
    own. A first line without one is the title whole, less its full stop."""
    line = (doc or "").strip().split("\n", 1)[0]
    depth, quoted = 0, False
    for i, ch in enumerate(line):
        if ch == "`":
            quoted = not quoted
        elif not quoted and ch in "([":
            depth += 1
        elif not quoted and ch in ")]":
            depth -= 1
        elif ch == ":" and not quoted and depth == 0:
            return line[:i].strip()
    return line.strip().rstrip(".")


@contextlib.contextmanager
def _private() -> Iterator[None]:
    """umask 077 while the command runs (then the caller's again: tests call these in
    their own process)."""
    old = private_umask()
    try:
        yield
    finally:
        os.umask(old)


def local_actor() -> Actor:
    """Who a change made on the server's own database is recorded as: the OS user."""
    from torchyard.store.audit import Actor

    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        name = f"uid{os.getuid()}"
    return Actor(None, f"{name}@local", "local")


def token_main(argv: list[str]) -> int:
    """`torchyard token create --local …` (the dispatcher drops `--local`)."""
    parser = argparse.ArgumentParser(prog="torchyard token --local", description=BOOTSTRAP)
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser(
        "create",
        help="bootstrap: the first admin's token, straight into the database; prints the token",
        description=BOOTSTRAP,
    )
    create.add_argument("--user", required=True, help="user name (created if missing)")
    create.add_argument("--admin", action="store_true", help="the user sees every job")
    create.add_argument(
        "--can-run-code",
        action="store_true",
        help="jobs of this user may run their own code: bundles, scripts, module:function "
        "factories; that code runs with the worker's privileges",
    )
    create.add_argument("--label", help="a name to tell the token apart by")
    args = parser.parse_args(argv)

    from torchyard.store.audit import record
    from torchyard.store.auth import issue_token
    from torchyard.store.db import session_scope

    if not 1 <= len(args.user) <= 100:
        parser.error("--user must be 1 to 100 characters")
    if args.label is not None and len(args.label) > 100:
        parser.error("--label must be at most 100 characters")
    with _private(), session_scope(get_settings().db_url) as session:
        row, token = issue_token(session, args.user, args.admin, args.can_run_code, args.label)
        details = {k: getattr(args, k) for k in ("user", "admin", "can_run_code", "label")}
        record(session, local_actor(), "token.create", f"token:{row.id}", details)
    # Only the token on stdout, so `TOKEN=$(torchyard token create --local …)` works.
    print(token)
    return 0
