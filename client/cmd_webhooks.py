"""The webhook commands, over the API: `webhook create URL --event E … [--project P]
[--secret S]` (prints the secret once), `webhook list`, `webhook delete ID`, `webhook
deliveries ID` (each delivery with its attempts). ID: a unique prefix will do, as for jobs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, age, note, print_json, show
from torchyard.client.sdk import Client

EVENTS = ("job.succeeded", "job.failed", "job.cancelled", "sweep.completed")


def add_webhook_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """webhook create, list, delete and deliveries (connection options on each)."""
    hook = sub.add_parser(
        "webhook",
        help="webhooks: create, list, delete, deliveries",
        description="POST job and sweep endings to a URL, signed (HMAC-SHA256).",
    )
    actions = hook.add_subparsers(dest="webhook_command", required=True, metavar="action")

    def action(name: str, fn: Callable[[Client, argparse.Namespace], int], help: str) -> Any:
        sp = actions.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        sp.add_argument("--json", action="store_true", help="print the answer as JSON")
        return sp

    sp = action("create", cmd_webhook_create, "send events to URL (prints the secret, once)")
    sp.add_argument("target", metavar="URL", help="an http:// or https:// URL")
    sp.add_argument(
        "--event",
        dest="events",
        action="append",
        required=True,
        choices=EVENTS,
        help="an event to send (repeat for more)",
    )
    sp.add_argument("--project", help="every job and sweep of this project (its owners)")
    sp.add_argument("--secret", help="the signing key (16-256 characters; default: made)")
    action("list", cmd_webhook_list, "your webhooks and those of projects you own")
    sp = action("delete", cmd_webhook_delete, "delete a webhook and its deliveries")
    sp.add_argument("id", help="the webhook's id, or a unique prefix (`torchyard webhook list`)")
    sp = action("deliveries", cmd_webhook_deliveries, "a webhook's deliveries and attempts")
    sp.add_argument("id", help="the webhook's id, or a unique prefix")
    sp.add_argument("--limit", type=int, default=20, help="newest N (default 20, most 200)")


def cmd_webhook_create(client: Client, args: argparse.Namespace) -> int:
    made = client.create_webhook(args.target, args.events, secret=args.secret, project=args.project)
    if args.json:
        print_json(made)
        return EXIT_OK
    print(made["secret"])  # only the secret on stdout: `S=$(torchyard webhook create …)`
    note(f"webhook {made['id']} → {made['url']}: its secret is shown this once")
    return EXIT_OK


def cmd_webhook_list(client: Client, args: argparse.Namespace) -> int:
    hooks = client.webhooks()
    if args.json:
        print_json(hooks)
        return EXIT_OK
    if not hooks:
        print("no webhooks")
        return EXIT_OK
    rows = [
        (h["id"], h["url"], ",".join(h["events"]), h.get("project") or "-", h.get("owner"),
         age(h.get("created_at")))
        for h in hooks
    ]  # fmt: skip
    show(render.table(["ID", "URL", "EVENTS", "PROJECT", "OWNER", "CREATED"], rows))
    return EXIT_OK


def cmd_webhook_delete(client: Client, args: argparse.Namespace) -> int:
    webhook_id = client.resolve_webhook_id(args.id)  # say the full id, not the prefix given
    client.delete_webhook(webhook_id)
    if args.json:
        print_json({"id": webhook_id, "deleted": True})
    else:
        note(f"webhook {webhook_id} deleted")
    return EXIT_OK


def _last(d: dict[str, Any]) -> str:
    tries = d.get("attempts") or []
    if not tries:
        return "-"
    a = tries[-1]
    return str(a.get("status_code") or a.get("error") or "-")


def cmd_webhook_deliveries(client: Client, args: argparse.Namespace) -> int:
    page = client.webhook_deliveries(args.id, limit=max(1, min(args.limit, 200)))
    items = page.get("items", [])
    if args.json:
        print_json(items)
        return EXIT_OK
    if not items:
        print("no deliveries")
        return EXIT_OK
    rows = [
        (d["id"], d["event"], d["subject"], d["state"], len(d.get("attempts") or []),
         _last(d), age(d.get("created_at")))
        for d in items
    ]  # fmt: skip
    show(render.table(["DELIVERY", "EVENT", "SUBJECT", "STATE", "TRIES", "LAST", "CREATED"], rows))
    return EXIT_OK
