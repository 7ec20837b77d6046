"""The sweep commands: sweep create, status, list and cancel (their options, what they
print) and `resolve_sweep_id`, a sweep id from a unique prefix. How a sweep is drawn is
client/sweep_view.py; following one is client/follow.py."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, FULL_ID, age, cancel_message, print_json, show
from torchyard.client.cmd_jobs import _say_packed  # what --code sent, as submit says it
from torchyard.client.errors import NotFound
from torchyard.client.follow import follow_sweep
from torchyard.client.sdk import Client, load_spec, match_prefix
from torchyard.client.sweep_view import best_short, describe_sweep, trials_done

_SWEEP_HELP = "sweep id (or a unique prefix)"
_SWEEP_FOLLOW = "show the trials, best first, until the sweep ends"
_SWEEP_INTERVAL = "--follow: seconds between reads of the sweep (default 2)"


def add_sweep_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """sweep create, status, list and cancel (the connection options on the innermost parser,
    as for `quota`)."""
    sweep = sub.add_parser("sweep", help="hyperparameter sweeps: create, status, list, cancel")
    actions = sweep.add_subparsers(dest="sweep_command", required=True, metavar="action")

    def action(name: str, fn: Callable[[Client, argparse.Namespace], int], help: str) -> Any:
        sp = actions.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        return sp

    sp = action("create", cmd_sweep_create, "start a sweep (JSON or YAML file); prints its id")
    sp.add_argument("file", help="path to the sweep file (.json, .yaml or .yml)")
    sp.add_argument(
        "--code",
        metavar="DIR",
        help="every trial runs the code in DIR: packed and uploaded once as `submit --code` "
        "does, set as the base spec's code.bundle (over one the file names)",
    )
    sp.add_argument("-f", "--follow", action="store_true", help=_SWEEP_FOLLOW)
    sp.add_argument("--interval", type=float, default=2.0, help=_SWEEP_INTERVAL)
    sp.add_argument("--json", action="store_true", help="print the created sweep as JSON")
    sp = action("status", cmd_sweep_status, "show a sweep: state, best trial, every trial")
    sp.add_argument("sweep", help=_SWEEP_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help=_SWEEP_FOLLOW)
    sp.add_argument("--interval", type=float, default=2.0, help=_SWEEP_INTERVAL)
    sp.add_argument("--json", action="store_true", help="print the sweep as JSON")
    sp = action("list", cmd_sweep_list, "list sweeps, newest first")
    sp.add_argument("--state", help="only sweeps in this state (running, succeeded, …)")
    sp.add_argument("-n", "--limit", type=int, default=20, help="how many (default 20)")
    sp.add_argument("--json", action="store_true", help="print the sweeps as JSON")
    sp = action("cancel", cmd_sweep_cancel, "cancel a sweep: its trials stop, no new one starts")
    sp.add_argument("sweep", help=_SWEEP_HELP)


def cmd_sweep_create(client: Client, args: argparse.Namespace) -> int:
    sweep = client.create_sweep(load_spec(args.file), code=args.code, on_packed=_say_packed)
    if args.json:
        print_json(sweep)
    else:
        print(sweep["id"], flush=True)
    if not args.follow:
        return EXIT_OK
    return follow_sweep(client, sweep["id"], interval_s=args.interval)


def cmd_sweep_status(client: Client, args: argparse.Namespace) -> int:
    sweep_id = resolve_sweep_id(client, args.sweep)
    if args.follow:
        return follow_sweep(client, sweep_id, interval_s=args.interval)
    sweep = client.get_sweep(sweep_id)
    if args.json:
        print_json(sweep)
    else:
        show(describe_sweep(sweep))
    return EXIT_OK


def cmd_sweep_list(client: Client, args: argparse.Namespace) -> int:
    sweeps: list[dict] = []
    cursor = None
    while len(sweeps) < args.limit:
        page = client.list_sweeps(
            state=args.state, limit=min(max(args.limit, 1), 100), cursor=cursor
        )
        sweeps += page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    sweeps = sweeps[: args.limit]
    if args.json:
        print_json(sweeps)
    elif not sweeps:
        print("no sweeps" + (f" in state {args.state}" if args.state else ""))
    else:
        rows = [
            (
                s["id"][:12],
                s.get("name"),
                s.get("state"),
                trials_done(s),
                best_short(s),
                age(s.get("created_at")),
            )
            for s in sweeps
        ]
        show(render.table(["ID", "NAME", "STATE", "TRIALS", "BEST", "CREATED"], rows))
    return EXIT_OK


def cmd_sweep_cancel(client: Client, args: argparse.Namespace) -> int:
    sweep_id = resolve_sweep_id(client, args.sweep)
    before = client.get_sweep(sweep_id).get("state")
    if before in ("succeeded", "failed", "cancelled"):
        print(cancel_message("sweep", sweep_id, before, already=True))
        return EXIT_OK
    state = (client.cancel_sweep(sweep_id) or {}).get("state")
    print(cancel_message("sweep", sweep_id, state, already=False))
    return EXIT_OK


def resolve_sweep_id(client: Client, ref: str) -> str:
    """A full id as is; otherwise the one sweep among the newest 500 whose id starts with
    `ref` (several: AmbiguousId naming them)."""
    if FULL_ID.match(ref):
        return ref
    if not re.fullmatch(r"[0-9a-f]{1,31}", ref):
        raise NotFound(404, "not_found", f"not a sweep id: {ref!r}")
    return match_prefix("sweep", ref, client.list_sweeps(limit=500).get("items", []), 500)
