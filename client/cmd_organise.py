"""The commands that organise jobs: tag, note, archive, delete and rerun (their options and
what they print). The requests are the SDK's (client/sdk.py: `tag`, `edit_job`, `archive`,
`delete_job`, `submit` with `rerun_of`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, JOB_HELP, err
from torchyard.client.cmd_jobs import announce_submitted
from torchyard.client.errors import TorchyardError
from torchyard.client.sdk import Client, rerun_spec

_INTERVAL_HELP = "--follow: at most one refresh of the job's progress per this many seconds"


class SetError(TorchyardError):
    """A `--set` whose path cannot be followed in the job's spec."""

    is_user_error = True


def add_organise_commands(cmd: Callable[..., Any]) -> None:
    """tag, note, archive, delete and rerun."""
    sp = cmd("tag", cmd_tag, "add or remove a job's tags; without options, print them")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("--add", action="append", default=[], metavar="TAG", help="add TAG (repeat for more)")  # fmt: skip
    sp.add_argument("--remove", action="append", default=[], metavar="TAG", help="remove TAG (repeat for more)")  # fmt: skip

    sp = cmd("note", cmd_note, "set a job's notes; without TEXT, print them")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("text", nargs="?", help="the new notes ('' clears them, - reads stdin)")

    sp = cmd("archive", cmd_archive, "hide a job from default lists (nothing is deleted)")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("--undo", action="store_true", help="show an archived job again")

    sp = cmd("delete", cmd_delete, "delete an ended job, its records and files, for good")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="do not ask first (needed when stdin is no terminal)",
    )

    sp = cmd("rerun", cmd_rerun, "submit a job's spec again, with changes; prints the new job id")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        type=_assignment,
        metavar="PATH=VALUE",
        help="set the spec's field at a dotted PATH (optimizer.lr=0.01, epochs=3); VALUE is "
        "read as JSON when it parses, else as a string; repeat for more",
    )
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--interval", type=float, default=0.5, help=_INTERVAL_HELP)
    sp.add_argument("--json", action="store_true", help="print the created job as JSON")


def _assignment(text: str) -> tuple[str, Any]:
    """`PATH=VALUE` as (path, value): the value as JSON when it parses, else the text."""
    path, eq, raw = text.partition("=")
    if not eq or not path.strip():
        raise argparse.ArgumentTypeError(f"expected PATH=VALUE (e.g. optimizer.lr=0.01), got {text!r}")  # fmt: skip
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return path.strip(), value


def _tags_line(job: dict) -> str:
    tags = job.get("tags") or []
    return "tags: " + ", ".join(tags) if tags else "no tags"


def cmd_tag(client: Client, args: argparse.Namespace) -> int:
    if args.add or args.remove:
        job = client.tag(args.job, add=args.add, remove=args.remove)
    else:
        job = client.job(args.job)
    print(_tags_line(job))
    return EXIT_OK


def cmd_note(client: Client, args: argparse.Namespace) -> int:
    if args.text is None:
        notes = client.job(args.job).get("notes")
        if notes:
            print(notes)
        return EXIT_OK
    text = sys.stdin.read() if args.text == "-" else args.text
    job = client.edit_job(args.job, notes=text)
    print("notes saved" if job.get("notes") else "notes cleared")
    return EXIT_OK


def cmd_archive(client: Client, args: argparse.Namespace) -> int:
    job = client.archive(args.job, undo=args.undo)
    print(f"{'archived' if job.get('archived') else 'unarchived'} {job['id']}")
    return EXIT_OK


def cmd_delete(client: Client, args: argparse.Namespace) -> int:
    if not args.yes and not sys.stdin.isatty():
        # A script or a pipe cannot answer the question: deleting unasked would be a guess.
        err("delete asks first, and stdin is not a terminal to ask on: pass --yes")
        return EXIT_USAGE
    job = client.job(args.job)
    if not args.yes:
        question = (
            f"Delete job {job['id']} ({job.get('name')}, {job.get('state')}) with its "
            "checkpoints, metrics and logs, for good? [y/N] "
        )
        try:
            answer = input(question)
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted", file=sys.stderr)
            return EXIT_FAIL
    client.delete_job(job["id"])
    print(f"deleted {job['id']}")
    return EXIT_OK


def cmd_rerun(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    try:
        spec = rerun_spec(client.job(job_id), dict(args.set))
    except ValueError as e:
        raise SetError(f"--set {e}") from None
    return announce_submitted(client, client.submit(spec, rerun_of=job_id), args)
