"""The client half of the `torchyard` command: the argument parser and `main`, which runs one
command. `main(argv)` takes the command name as argv[0]. The commands themselves live by group:
client/cmd_jobs.py (submit, status, list, cancel, logs), client/cmd_organise.py (tag, note,
archive, delete, rerun), client/cmd_results.py (metrics, download), client/cmd_artifacts.py (artifacts),
client/cmd_pool.py
(workers, quota, queue), client/cmd_sweeps.py (sweep …),
client/cmd_tokens.py (token list|create|revoke), client/cmd_users.py (user set|link),
client/cmd_audit.py (audit), client/cmd_data.py (data upload),
client/cmd_projects.py (project create|list|show|add|remove),
client/cmd_login.py (login); --follow is
client/follow.py. The server's URL and token are
looked up as client/config.py says.

Exit codes: 0 success (a cancel that finds the job ended too); 1 a failure (server
unreachable, token refused, job failed or cancelled, not found, over a quota); 2 bad input (a
spec the server rejected, an unreadable spec or login file, a wrong option, an ambiguous id
prefix); 130 interrupted (a note, not an error). Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from torchyard.client.cli_common import (
    CONNECTION_HELP,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    err,
    note,
)
from torchyard.client.cmd_artifacts import add_artifact_commands
from torchyard.client.cmd_audit import add_audit_command
from torchyard.client.cmd_data import add_data_commands
from torchyard.client.cmd_jobs import add_job_commands, describe_job
from torchyard.client.cmd_login import add_login_command
from torchyard.client.cmd_organise import add_organise_commands
from torchyard.client.cmd_pool import add_pool_commands, describe_queue
from torchyard.client.cmd_projects import add_project_commands
from torchyard.client.cmd_results import (
    add_result_commands,
    describe_download,
    wide_rows,
    write_csv,
)
from torchyard.client.cmd_sweeps import add_sweep_commands, resolve_sweep_id
from torchyard.client.cmd_tokens import add_token_commands
from torchyard.client.cmd_users import add_user_commands
from torchyard.client.cmd_webhooks import add_webhook_commands
from torchyard.client.config import resolve
from torchyard.client.errors import APIError, TorchyardError
from torchyard.client.follow import follow_job, follow_sweep, progress_line, summary_line
from torchyard.client.sdk import Client
from torchyard.client.sweep_view import describe_sweep, sweep_summary_line

# Importable from here as before the split (tests and other code name them so).
__all__ = [
    "EXIT_FAIL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "describe_download",
    "describe_job",
    "describe_queue",
    "describe_sweep",
    "follow_job",
    "follow_sweep",
    "main",
    "progress_line",
    "resolve_sweep_id",
    "summary_line",
    "sweep_summary_line",
    "wide_rows",
    "write_csv",
]


def main(
    argv: Sequence[str] | None = None,
    *,
    transport: httpx.BaseTransport | None = None,
    http: httpx.Client | None = None,
) -> int:
    """Run one client command. `http` (an httpx.Client, e.g. a TestClient of the app) or
    `transport` replaces the network."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line complaint and usage
        return EXIT_OK if e.code in (0, None) else EXIT_USAGE
    try:
        url = args.url or (str(http.base_url) if http is not None else None)
        given = ("the URL argument" if args.command == "login" else "--url", "--token")
        conn = resolve(url, args.token, given=given)
        with Client(
            timeout=args.timeout, transport=transport, http=http, connection=conn
        ) as client:
            return int(args.run(client, args) or EXIT_OK)
    except TorchyardError as e:
        err(str(e) if not isinstance(e, APIError) else e.one_line())
        return EXIT_USAGE if e.is_user_error else EXIT_FAIL
    except KeyboardInterrupt:  # Ctrl-C is the user's choice, not an error
        note("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `torchyard metrics … | head`
        return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection", CONNECTION_HELP)
    g.add_argument("--url", help="API URL")
    g.add_argument("--token", help="API token (`torchyard token create` makes one)")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")

    p = argparse.ArgumentParser(
        prog="torchyard", description="torchyard client", epilog=CONNECTION_HELP
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    def cmd(name: str, fn: Command, help: str) -> Any:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        return sp

    add_job_commands(cmd)  # submit, status, list, cancel, logs
    add_organise_commands(cmd)  # tag, note, archive, delete, rerun
    add_result_commands(cmd)  # metrics, download
    add_artifact_commands(cmd)  # artifacts
    add_pool_commands(cmd, sub, common)
    add_sweep_commands(sub, common)
    add_token_commands(sub, common)
    add_user_commands(sub, common)
    add_audit_command(sub, common)
    add_project_commands(sub, common)
    add_webhook_commands(sub, common)
    add_data_commands(sub, common)
    add_login_command(sub)
    return p


if __name__ == "__main__":
    sys.exit(main())
