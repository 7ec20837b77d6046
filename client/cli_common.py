"""What every client command module shares: the exit codes, how long --follow retries an
unreachable API, the job id's help text, the writers to stdout and stderr (a table, JSON, a
note, a one-line error) and the formatting of ages, durations and numbers."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rich.console import RenderableType

from torchyard.client import render
from torchyard.client.config import LOOKUP_ORDER
from torchyard.client.sdk import Client

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
FULL_ID = re.compile(r"^[0-9a-f]{32}$")
# How long --follow keeps retrying while the API is unreachable (e.g. `up` restarting).
RECONNECT_FOR_S = 180.0

JOB_HELP = "job id (or a unique prefix)"
CONNECTION_HELP = f"URL and token, first found: {LOOKUP_ORDER}"

# A command's function: it gets the client and the parsed arguments, returns the exit code.
Command = Callable[[Client, argparse.Namespace], int]


def command_group(
    sub: Any, common: argparse.ArgumentParser, name: str, help: str, description: str
) -> Callable[[str, Command, str], argparse.ArgumentParser]:
    """A command with actions (`torchyard NAME ACTION`); returns `action(name, fn, help)`,
    which adds one with the connection options on it: argparse lets a subcommand's
    defaults overwrite what its parent parsed, so they belong on the innermost parser."""
    group = sub.add_parser(name, help=help, description=description)
    actions = group.add_subparsers(dest=f"{name}_command", required=True, metavar="action")

    def action(action_name: str, fn: Command, action_help: str) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = actions.add_parser(
            action_name, parents=[common], help=action_help, description=action_help
        )
        sp.set_defaults(run=fn)
        return sp

    return action


def show(renderable: RenderableType) -> None:
    render.show(renderable, sys.stdout)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def note(msg: str) -> None:
    """A line on stderr that is no error (Ctrl-C on --follow is a normal way to stop)."""
    print(msg, file=sys.stderr)


def err(msg: str) -> None:
    first, *rest = str(msg).splitlines() or [""]
    print(f"error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)


def num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def age(value: Any) -> str:
    t = parse_time(value)
    if t is None:
        return "-"
    return render.human_age((datetime.now(UTC) - t).total_seconds())


def duration(start: Any, end: Any) -> str | None:
    a, b = parse_time(start), parse_time(end)
    return render.human_duration((b - a).total_seconds()) if a and b else None


def cancel_message(what: str, ident: str, state: str | None, *, already: bool) -> str:
    """What `cancel` prints for a job or a sweep, in one form."""
    if already:
        return f"{what} {ident} already {state}: nothing to cancel"
    if state == "cancelled":
        return f"{what} {ident} cancelled"
    return f"{what} {ident}: cancel requested (now {state or 'stopping'})"
