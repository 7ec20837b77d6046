"""`torchyard artifacts JOB [--download NAME] [-o PATH] [--json]`: the files a script job kept
with `job.save_artifact` as a table (name, size, sha256, age), or one of them downloaded,
resumable and sha256-verified (client/sdk.py `download_artifact`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from torchyard.client import render
from torchyard.client.cli_common import EXIT_OK, JOB_HELP, age, note, print_json, show
from torchyard.client.sdk import Client


def add_artifact_commands(cmd: Callable[..., Any]) -> None:
    sp = cmd(
        "artifacts", cmd_artifacts, "list a job's artifacts, or download one (sha256-verified)"
    )
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("-d", "--download", metavar="NAME", help="download the artifact NAME")
    sp.add_argument("-o", "--output", help="file or directory to write (default: ./NAME)")
    sp.add_argument("--json", action="store_true", help="the list as JSON")


def cmd_artifacts(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    if args.download:
        transfer = render.Transfer(sys.stderr)
        dl = client.download_artifact(job_id, args.download, args.output, on_progress=transfer)
        transfer.done(dl.bytes)
        print(f"saved {dl.path} ({render.human_bytes(dl.bytes)}, sha256 {dl.sha256} verified)")
        return EXIT_OK
    items = client.artifacts(job_id)
    if args.json:
        print_json(items)
    elif not items:
        note(f"job {job_id} has no artifacts (a script saves them with job.save_artifact)")
    else:
        rows = [[a["name"], render.human_bytes(a["bytes"]), a["sha256"][:12],
                 age(a.get("created_at")), "" if a.get("available", True) else "gone"]
                for a in items]  # fmt: skip
        show(render.table(["NAME", "SIZE", "SHA256", "SAVED", ""], rows))
    return EXIT_OK
