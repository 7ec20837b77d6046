"""`torchyard audit`: the audit trail, newest first (admins: every entry; a project's owners:
its entries), filtered by user, action (`job.` for every job change), target, project and
time, following the server's cursor up to --limit entries."""

from __future__ import annotations

import argparse
import json
from datetime import UTC
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, parse_time, print_json, show
from torchyard.client.sdk import Client

PAGE = 500  # the most the server answers at once
DETAILS_WIDTH = 80


def add_audit_command(sub: Any, common: argparse.ArgumentParser) -> None:
    what = "the audit trail: who changed what, when, from where (admins; project owners)"
    sp = sub.add_parser("audit", parents=[common], help=what, description=what)
    sp.set_defaults(run=cmd_audit)
    sp.add_argument("--user", help="only changes this user made")
    sp.add_argument("--action", help="only this action (e.g. job.cancel); ending in '.': a prefix")
    sp.add_argument("--target", help="only changes of this target (e.g. job:<id>, token:<id>)")
    sp.add_argument("--project", help="only changes in this project (you must own it)")
    sp.add_argument("--since", metavar="ISO", help="only changes at or after this time")
    sp.add_argument("--until", metavar="ISO", help="only changes before this time")
    sp.add_argument(
        "-n", "--limit", type=_positive, default=50, help="most entries shown (default 50)"
    )
    sp.add_argument("--json", action="store_true", help="print the entries as JSON")


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {value!r}")
    return int(value)


def fetch_entries(client: Client, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Up to args.limit entries, newest first, page after page."""
    filters = {
        k: getattr(args, k) for k in ("user", "action", "target", "project", "since", "until")
    }
    entries: list[dict[str, Any]] = []
    cursor = None
    while len(entries) < args.limit:
        page = client.audit(**filters, limit=min(PAGE, args.limit - len(entries)), cursor=cursor)
        entries += page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return entries[: args.limit]


def _time(value: Any) -> str:
    t = parse_time(value)
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _details(details: Any) -> str:
    """The details as compact JSON on one line, cut at DETAILS_WIDTH (--json: whole)."""
    text = json.dumps(details or {}, separators=(",", ":"), sort_keys=True)
    if text == "{}":
        return "-"
    return text if len(text) <= DETAILS_WIDTH else text[: DETAILS_WIDTH - 1] + "…"


def cmd_audit(client: Client, args: argparse.Namespace) -> int:
    entries = fetch_entries(client, args)
    if args.json:
        print_json(entries)
        return EXIT_OK
    if not entries:
        print("no audit entries (admins see every entry; a project's owners see its entries)")
        return EXIT_OK
    rows = [
        (_time(e.get("time")), e.get("user"), e.get("action"), e.get("target"),
         e.get("client") or "-", _details(e.get("details")))
        for e in entries
    ]  # fmt: skip
    show(render.table(["TIME", "USER", "ACTION", "TARGET", "CLIENT", "DETAILS"], rows))
    return EXIT_OK
