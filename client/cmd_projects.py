"""The project commands: `project create NAME`, `project list`, `project show NAME`,
`project add NAME USER [--role viewer|member|owner]`, `project remove NAME USER`. A job goes
into a project with the spec's `project` (or `torchyard submit --project NAME`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, age, note, print_json, show
from torchyard.client.sdk import Client

ROLES = ("viewer", "member", "owner")


def add_project_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """project create, list, show, add and remove (connection options on the innermost)."""
    project = sub.add_parser(
        "project",
        help="projects: share jobs with a team (viewer, member, owner)",
        description="Projects and their members. Viewers see a project's jobs, metrics, "
        "logs and checkpoints; members also submit and cancel; owners manage members.",
    )
    actions = project.add_subparsers(dest="project_command", required=True, metavar="action")

    def action(name: str, fn: Callable[[Client, argparse.Namespace], int], help: str) -> Any:
        sp = actions.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        sp.add_argument("--json", action="store_true", help="print the answer as JSON")
        return sp

    sp = action("create", cmd_project_create, "make a project; you become its owner")
    sp.add_argument("name", help="letters, digits, '.', '_' or '-'")
    action("list", cmd_project_list, "the projects you have a role in (an admin: all)")
    sp = action("show", cmd_project_show, "a project's members and their roles")
    sp.add_argument("name", help="a project (`~USER`: a user's personal project)")
    sp = action("add", cmd_project_add, "give a user a role in a project (owners)")
    sp.add_argument("name", help="the project")
    sp.add_argument("user", help="the user")
    sp.add_argument("--role", choices=ROLES, default="member", help="default: member")
    sp = action("remove", cmd_project_remove, "take a user out of a project (owners; or yourself)")
    sp.add_argument("name", help="the project")
    sp.add_argument("user", help="the user")


def _show_project(project: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print_json(project)
        return EXIT_OK
    kind = "personal" if project.get("personal") else "team"
    print(f"{project['name']} ({kind}; your role: {project.get('role') or 'none (admin)'})")
    rows = [(m["user"], m["role"]) for m in project.get("members", [])]
    if rows:
        show(render.table(["USER", "ROLE"], rows))
    return EXIT_OK


def cmd_project_create(client: Client, args: argparse.Namespace) -> int:
    made = client.create_project(args.name)
    if not args.json:
        note(f"project {made['name']} created; you own it")
    return _show_project(made, args.json)


def cmd_project_list(client: Client, args: argparse.Namespace) -> int:
    projects = client.projects()
    if args.json:
        print_json(projects)
        return EXIT_OK
    rows = [
        (p["name"], "personal" if p.get("personal") else "team", p.get("role") or "-",
         p.get("members"), age(p.get("created_at")))
        for p in projects
    ]  # fmt: skip
    show(render.table(["PROJECT", "KIND", "ROLE", "MEMBERS", "CREATED"], rows))
    return EXIT_OK


def cmd_project_show(client: Client, args: argparse.Namespace) -> int:
    return _show_project(client.project(args.name), args.json)


def cmd_project_add(client: Client, args: argparse.Namespace) -> int:
    project = client.set_member(args.name, args.user, args.role)
    if not args.json:
        note(f"{args.user} is now {args.role} of {args.name}")
    return _show_project(project, args.json)


def cmd_project_remove(client: Client, args: argparse.Namespace) -> int:
    project = client.remove_member(args.name, args.user)
    if not args.json:
        note(f"{args.user} is no longer in {args.name}")
    return _show_project(project, args.json)
