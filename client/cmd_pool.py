"""The pool's commands: workers (who is there and what each runs), quota set and show (a
user's or a project's limits and fair-share weight), queue (queued jobs in the order they would start, and
each user's usage), with their option parsers and `describe_queue`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from rich.console import Group, RenderableType

from torchyard.client import render
from torchyard.client.cli_common import (
    EXIT_OK,
    EXIT_USAGE,
    age,
    err,
    num,
    print_json,
    show,
)
from torchyard.client.sdk import Client
from torchyard.contracts.plurals import plural

_QUOTA_FIELDS = ("max_workers", "max_queued", "share", "max_priority")
_NO_LIMIT = ("none", "unlimited")


def add_pool_commands(cmd: Callable[..., Any], sub: Any, common: argparse.ArgumentParser) -> None:
    """workers, quota set, quota show and queue. The connection options belong to the
    innermost parser only: argparse lets a subcommand's defaults overwrite what its parent
    parsed."""
    sp = cmd("workers", cmd_workers, "list workers: host, GPU, state, current job, heartbeat")
    sp.add_argument("--json", action="store_true", help="print the workers as JSON")
    quota = sub.add_parser(
        "quota", help="show or set a user's or a project's quota (setting: admins)"
    )
    actions = quota.add_subparsers(dest="quota_command", required=True, metavar="action")
    sp = actions.add_parser(
        "set",
        parents=[common],
        help="change a user's or a project's quota (admins); options not given are left as "
        "they are",
        description="change a user's quota, or with --project a project's (admins; both "
        "hold: a job needs room under each); options not given are left as they are",
    )
    sp.set_defaults(run=cmd_quota_set)
    sp.add_argument("user", nargs="?", help="user name (or --project)")
    sp.add_argument("--project", help="a project's quota instead (no --max-priority)")
    unset = {"default": argparse.SUPPRESS, "metavar": "N|none"}  # absent: left as it is
    limit = "most workers the user's jobs hold at once (none: no limit)"
    sp.add_argument("--max-workers", type=_limit, help=limit, **unset)
    queued = "most queued jobs the user may have; a submit over it is refused (none: no limit)"
    sp.add_argument("--max-queued", type=_limit, help=queued, **unset)
    share = "fair-share weight, > 0: 2 may use twice as much (none: back to 1)"
    sp.add_argument("--share", type=_share, help=share, **unset | {"metavar": "S|none"})
    top = (
        "highest priority the user may give a job, -1000 to 1000; another user's job "
        "preempts theirs only above it (default: back to 0)"
    )
    sp.add_argument("--max-priority", type=_priority, help=top, **unset | {"metavar": "P|default"})
    sp.add_argument("--json", action="store_true", help="print the quota as JSON")
    sp = actions.add_parser(
        "show",
        parents=[common],
        help="show a user's quota (default: yours)",
        description="show a user's quota (default: yours; another user's: admins)",
    )
    sp.set_defaults(run=cmd_quota_show)
    sp.add_argument("user", nargs="?", help="user name (default: yourself; others: admins)")
    sp.add_argument("--project", help="a project's quota instead (its members and admins)")
    sp.add_argument("--json", action="store_true", help="print the quota as JSON")
    sp = sub.add_parser(
        "queue",
        parents=[common],
        help="queued jobs in the order they would start, and each user's usage",
        description="queued jobs in the order they would start (priority, fair share, age) "
        "and each user's usage; a non-admin sees their own jobs only",
    )
    sp.set_defaults(run=cmd_queue)
    sp.add_argument("-n", "--limit", type=int, default=200, help="most jobs listed (default 200)")
    sp.add_argument("--json", action="store_true", help="print the queue as JSON")


def cmd_workers(client: Client, args: argparse.Namespace) -> int:
    workers = client.workers()
    if args.json:
        print_json(workers)
        return EXIT_OK
    if not workers:
        print("no workers registered (start one: `torchyard worker --device cpu` or `--gpu 0`)")
        return EXIT_OK
    rows = [
        (
            w.get("id"),
            w.get("host"),
            w.get("pid"),
            "cpu" if w.get("gpu") is None else w.get("gpu"),
            w.get("state"),
            (w.get("current_job_id") or "-")[:12],
            age(w.get("last_heartbeat")),
        )
        for w in workers
    ]
    show(render.table(["ID", "HOST", "PID", "GPU", "STATE", "JOB", "HEARTBEAT"], rows))
    return EXIT_OK


def _limit(value: str) -> int | None:
    if value.lower() in _NO_LIMIT:
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or `none`: {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, or `none` for no limit: {n}")
    return n


def _share(value: str) -> float | None:
    if value.lower() in (*_NO_LIMIT, "default"):
        return None
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, or `none` for 1: {value!r}")
    return x


def _priority(value: str) -> int | None:
    if value.lower() in (*_NO_LIMIT, "default"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or `default`: {value!r}") from None
    if not -1000 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"must be from -1000 to 1000, or `default`: {n}")
    return n


def cmd_quota_set(client: Client, args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in _QUOTA_FIELDS if hasattr(args, k)}
    if (args.user is None) == (args.project is None):
        err("give a USER or --project NAME (one of them)")
        return EXIT_USAGE
    if args.project is not None and "max_priority" in fields:
        err("a project has no --max-priority: it stays a user's (`quota set USER`)")
        return EXIT_USAGE
    if not fields:
        err("nothing to set: give --max-workers, --max-queued, --share and/or --max-priority")
        return EXIT_USAGE
    if args.project is not None:
        _show_quota(client.set_project_quota(args.project, **fields), args.json)
    else:
        _show_quota(client.set_quota(args.user, **fields), args.json)
    return EXIT_OK


def cmd_quota_show(client: Client, args: argparse.Namespace) -> int:
    if args.project is not None:
        if args.user is not None:
            err("give a USER or --project NAME, not both")
            return EXIT_USAGE
        _show_quota(client.project_quota(args.project), args.json)
    else:
        _show_quota(client.get_quota(args.user or "me"), args.json)
    return EXIT_OK


def _show_quota(quota: dict, as_json: bool) -> None:
    if as_json:
        print_json(quota)
        return
    whose = "project" if "project" in quota else "user"
    rows = [(whose, str(quota.get(whose)))]
    for key in ("max_workers", "max_queued"):
        rows.append((key, "no limit" if quota.get(key) is None else str(quota[key])))
    rows.append(("share", num(quota.get("share"))))
    if quota.get("max_priority") is not None:
        rows.append(("max_priority", str(quota["max_priority"])))
    show(render.fields(rows))


def cmd_queue(client: Client, args: argparse.Namespace) -> int:
    q = client.queue(limit=max(args.limit, 1))
    if args.json:
        print_json(q)
        return EXIT_OK
    show(describe_queue(q, args.limit))
    return EXIT_OK


def describe_queue(q: dict, limit: int | None = None) -> RenderableType:
    """The queue as a table, then each user's usage and limits."""
    counts, items, unit = q.get("counts") or {}, q.get("items") or [], q.get("unit") or "worker"
    head = (
        f"{plural(counts.get('queued', 0), 'queued job')} from "
        f"{plural(counts.get('users', 0), 'user')}, {counts.get('mine', 0)} of them yours"
    )
    if limit is not None and len(items) >= limit:
        head += f" (the first {len(items)} shown; --limit for more)"
    parts: list[RenderableType] = [head]
    if items:
        rows = [
            (i.get("position"), str(i.get("id"))[:12], i.get("name"), i.get("owner"),
             i.get("priority"), i.get("world_size"), i.get("pending_reason") or "-")
            for i in items
        ]  # fmt: skip
        headers = ["#", "ID", "NAME", "OWNER", "PRIORITY", "WORKERS", "PENDING REASON"]
        parts += ["", render.table(headers, rows)]
    usage = q.get("usage") or {}
    if usage:
        usage_rows = [
            (name, f"{u.get('worker_hours') or 0:.2f}", u.get("share"),
             _or_none(u.get("max_workers")), _or_none(u.get("max_queued")))
            for name, u in usage.items()
        ]  # fmt: skip
        parts += [
            "",
            f"usage ({unit}-hours, half-life {_half_life(q.get('half_life_s'))}; fair share "
            "orders users by usage / share):",
            render.table(
                ["USER", f"{unit.upper()}-H", "SHARE", "MAX WORKERS", "MAX QUEUED"], usage_rows
            ),
        ]
    return Group(*parts)


def _or_none(v: Any) -> Any:
    return "no limit" if v is None else v


def _half_life(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    days = seconds / 86_400
    if days >= 1 and days.is_integer():
        return plural(int(days), "day")
    return f"{seconds / 3600:g} h"
