"""The job commands: submit, status, list, cancel and logs (their options, what they print)
and `describe_job`, the job as `status` shows it. Following a job is client/follow.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Group, RenderableType

from torchyard.client import render
from torchyard.client.bundle import IGNORE_FILE, Packed
from torchyard.client.cli_common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    JOB_HELP,
    age,
    cancel_message,
    note,
    num,
    print_json,
    show,
)
from torchyard.client.errors import Conflict
from torchyard.client.follow import follow_job
from torchyard.client.logsearch import add_grep_options, cmd_grep
from torchyard.client.sdk import TERMINAL_STATES, Client, load_spec
from torchyard.client.specfile import print_warnings
from torchyard.client.sysview import is_system
from torchyard.contracts.plurals import plural

_MAX_PAGE = 500  # the most jobs GET /v1/jobs answers with at once
_INTERVAL_HELP = "--follow: at most one refresh of the job's progress per this many seconds"


def add_job_commands(cmd: Callable[..., Any]) -> None:
    """submit, status, list, cancel and logs."""
    sp = cmd("submit", cmd_submit, "submit a job spec (JSON or YAML); prints the job id")
    sp.add_argument("spec", help="path to the spec file (.json, .yaml or .yml)")
    sp.add_argument(
        "--code",
        metavar="DIR",
        help="run the job with the code in DIR: packed into a bundle (honouring "
        ".torchyardignore), uploaded unless the server has it already, set as code.bundle",
    )
    sp.add_argument("--project", help="the project to submit into (the spec's `project`)")
    sp.add_argument(
        "--tag", action="append", default=[], help="a tag for the job (repeat for several)"
    )
    sp.add_argument("--note", help="a note kept on the job (the spec's `notes`)")
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--idempotency-key", help="retrying with the same key returns the same job")
    sp.add_argument("--interval", type=float, default=0.5, help=_INTERVAL_HELP)
    sp.add_argument("--json", action="store_true", help="print the created job as JSON")

    sp = cmd("status", cmd_status, "show a job: state, progress, latest metrics, attempts")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--interval", type=float, default=0.5, help=_INTERVAL_HELP)
    sp.add_argument("--json", action="store_true", help="print the job as JSON")

    sp = cmd("list", cmd_list, "list jobs, newest first")
    sp.add_argument(
        "--state",
        action="append",
        help="only jobs in this state (queued, running, succeeded, …); repeat for several",
    )
    sp.add_argument("-n", "--limit", type=_positive, default=20, help="how many (default 20)")
    sp.add_argument("--cursor", help="start after the jobs shown before (printed when more exist)")
    sp.add_argument("--all", action="store_true", help="every job, page after page (not -n)")
    sp.add_argument("--tag", help="only jobs with this tag (`torchyard tag JOB --add TAG`)")
    sp.add_argument("--project", help="only this project's jobs (`torchyard project list`)")
    sp.add_argument("--archived", action="store_true", help="archived jobs too (hidden otherwise)")
    sp.add_argument("--json", action="store_true", help="print the jobs as JSON")

    sp = cmd("cancel", cmd_cancel, "cancel a job (idempotent)")
    sp.add_argument("job", help=JOB_HELP)

    sp = cmd("logs", cmd_logs, "print a job's output (the trainer's stdout and stderr)")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    sp.add_argument(
        "--rank",
        type=_rank,
        default=0,
        help="another rank's output (a job of several ranks on an object store: each rank's "
        "host keeps its own log; default 0)",
    )
    start = sp.add_mutually_exclusive_group()
    start.add_argument("--offset", type=int, default=0, help="start at this byte")
    start.add_argument("-n", "--tail", type=int, metavar="N", help="start at the last N lines")
    add_grep_options(sp)  # --grep, --ignore-case, --context: client/logsearch.py


def _rank(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a rank (0, 1, …), got {value!r}")
    return n


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1: {value!r}")
    return n


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    spec = dict(load_spec(args.spec))
    if args.project:
        spec["project"] = args.project
    if args.tag:
        spec["tags"] = [*(spec.get("tags") or []), *args.tag]
    if args.note:
        spec["notes"] = args.note
    job = client.submit(
        spec, code=args.code, idempotency_key=args.idempotency_key, on_packed=_say_packed
    )
    return announce_submitted(client, job, args)


def announce_submitted(client: Client, job: dict, args: argparse.Namespace) -> int:
    """A stored job as `submit` and `rerun` print it: its id (or JSON), its warnings, and
    with --follow its progress until it ends."""
    if args.json:
        print_json(job)
    else:
        print(job["id"], flush=True)
    print_warnings(job)  # stderr: the job is stored all the same
    if not args.follow:
        return EXIT_OK
    return follow_job(client, job["id"], interval_s=args.interval)


BIG_FILE = 10 << 20  # a file this large in a code bundle is worth a word


def _say_packed(p: Packed, compressed: int, uploaded: bool) -> None:
    """On stderr: what `--code` sent, so a stray data file or checkout does not go unseen."""
    how = "uploaded" if uploaded else "already on the server"
    sizes = f"{render.human_bytes(p.raw_bytes)} ({render.human_bytes(compressed)} packed)"
    note(
        f"code: {plural(p.files, 'file')}, {sizes}, {how}"
        + (f"; left out: {', '.join(p.left_out)}" if p.left_out else "")
    )
    big = [(n, b) for n, b in p.largest if b >= BIG_FILE]
    if big:
        listed = ", ".join(f"{n} ({render.human_bytes(b)})" for n, b in big)
        note(
            f"code: large files in the bundle: {listed}; list what the job does not need in "
            f"{IGNORE_FILE} (gitignore syntax) in the code folder"
        )


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    if args.follow:
        return follow_job(client, job_id, interval_s=args.interval)
    job = client.job(job_id)
    if args.json:
        print_json(job)
    else:
        show(describe_job(job))
    return EXIT_OK


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    jobs, cursor = _list_pages(client, args)
    if cursor:  # stderr: stdout stays the table (or the JSON) alone
        again = "".join(f" --state {s}" for s in args.state or [])
        again += f" --tag {args.tag}" if args.tag else ""
        again += f" --project {args.project}" if args.project else ""
        again += " --archived" if args.archived else ""
        print(
            f"… more jobs: torchyard list{again} -n {args.limit} --cursor {cursor} "
            "(or --all for every one)",
            file=sys.stderr,
        )
    if args.json:
        print_json(jobs)
        return EXIT_OK
    if not jobs:
        states = " or ".join(args.state or [])
        print("no jobs" + (f" in state {states}" if states else ""))
        return EXIT_OK
    show(_list_table(jobs, archived=args.archived))
    return EXIT_OK


def state_label(job: dict, *, long: bool = False) -> str:
    """The job's state, or `pruned` for a trial its sweep's pruner stopped (its state is
    cancelled: said in full with `long`)."""
    state = str(job.get("state"))
    if not job.get("pruned"):
        return state
    return f"pruned by its sweep ({state})" if long else "pruned"


def _list_table(jobs: list[dict], *, archived: bool) -> RenderableType:
    """The jobs as `list` prints them; with --archived, an ARCHIVED column (yes or -) tells
    the archived rows from the live ones, which otherwise look alike."""
    headers = ["ID", "NAME", "STATE", "ATTEMPT", "PROGRESS", "CREATED"]
    rows: list[tuple[Any, ...]] = [
        (j["id"][:12], j.get("name"), state_label(j), j.get("attempt"), _progress_short(j),
         age(j.get("created_at")))
        for j in jobs
    ]  # fmt: skip
    if archived:
        headers.append("ARCHIVED")
        rows = [(*r, "yes" if j.get("archived") else "-") for r, j in zip(rows, jobs, strict=True)]
    return render.table(headers, rows)


def _list_pages(client: Client, args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """Up to -n jobs (every one with --all) and the cursor after the last, when more exist.
    Each page asks for just what is missing, so the server's cursor is exactly there."""
    jobs: list[dict] = []
    cursor = args.cursor
    while args.all or len(jobs) < args.limit:
        want = _MAX_PAGE if args.all else min(args.limit - len(jobs), _MAX_PAGE)
        archived = "any" if args.archived else None
        page = client.jobs(
            state=args.state,
            limit=want,
            cursor=cursor,
            tag=args.tag,
            archived=archived,
            project=args.project,
        )
        jobs += page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return jobs, cursor


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 whenever the job no longer runs: cancelled now, before, or already ended (a
    cancel that finds nothing to stop has still got what it asked for)."""
    job_id = client.resolve_job_id(args.job)
    before = client.job(job_id).get("state")
    if before in TERMINAL_STATES:  # cancelled before, or ended: the same words either way
        print(cancel_message("job", job_id, before, already=True))
        return EXIT_OK
    try:
        job = client.cancel(job_id) or {}
    except Conflict as e:  # it ended between the two requests
        state = e.details.get("state") if isinstance(e.details, dict) else None
        if state not in TERMINAL_STATES:
            raise
        print(cancel_message("job", job_id, state, already=True))
        return EXIT_OK
    state = job.get("state") if isinstance(job, dict) else None
    print(cancel_message("job", job_id, state, already=False))
    return EXIT_OK


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    if args.grep is not None:
        return cmd_grep(client, job_id, args)  # client/logsearch.py
    out = sys.stdout
    offset = args.offset
    if args.tail is not None:
        tail = client.log_tail(job_id, args.tail, rank=args.rank)
        out.write(tail["data"])
        out.flush()
        if not args.follow:
            return EXIT_OK
        offset = tail["next_offset"]
    if args.follow:
        try:
            for text in client.follow_logs(job_id, offset=offset, rank=args.rank):
                out.write(text)
                out.flush()
        except KeyboardInterrupt:
            note(f"stopped following the log; the job goes on (torchyard status {job_id})")
            return EXIT_INTERRUPTED
        return EXIT_OK
    while True:  # the whole log, window by window
        chunk = client.logs(job_id, offset=offset, rank=args.rank)
        out.write(chunk.get("data") or "")
        nxt = int(chunk.get("next_offset", offset))
        if nxt <= offset or nxt >= int(chunk.get("size", nxt)):
            break
        offset = nxt
    out.flush()
    return EXIT_OK


# -- the job as `status` shows it -----------------------------------------------------------------


def describe_job(job: dict) -> RenderableType:
    rows: list[tuple[str, str]] = [
        ("id", str(job.get("id"))),
        ("name", str(job.get("name"))),
        ("state", f"{state_label(job, long=True)} (attempt {job.get('attempt')})"),
        *_organised(job),
    ]
    if job.get("pending_reason") and job.get("state") == "queued":
        rows.append(("waiting", str(job["pending_reason"])))
    if job.get("progress"):
        rows.append(("progress", _progress_long(job)))
    if job.get("error"):
        rows.append(("error", str(job["error"])))
    for key in ("created_at", "started_at", "finished_at"):
        if job.get(key):
            rows.append((key.removesuffix("_at"), f"{job[key]} ({age(job[key])} ago)"))
    lm = {n: v for n, v in (job.get("latest_metrics") or {}).items() if not is_system(n)}
    if lm:
        rows.append(("metrics", ", ".join(f"{n} {_metric_value(v)}" for n, v in lm.items())))
    attempts = job.get("attempts") or []
    if not attempts:
        return render.fields(rows)
    table_rows = [
        (
            a.get("number", i + 1),
            a.get("state"),
            ",".join(str(w.get("worker_id")) for w in a.get("workers") or []) or "-",
            a.get("started_at") or "-",
            a.get("ended_at") or "-",
            a.get("exit_code"),
            a.get("reason") or "",
        )
        for i, a in enumerate(attempts)
    ]
    headers = ["#", "STATE", "WORKERS", "STARTED", "ENDED", "EXIT", "REASON"]
    return Group(render.fields(rows), "", "attempts:", render.table(headers, table_rows))


def _organised(job: dict) -> list[tuple[str, str]]:
    """Its project (a team's), tags, archive, re-run and notes, where the job has them
    (client/cmd_organise.py)."""
    project = job.get("project")
    rows = [("project", str(project))] if project and not str(project).startswith("~") else []
    if job.get("tags"):
        rows.append(("tags", ", ".join(job["tags"])))
    if job.get("archived"):
        rows.append(("archived", f"{job.get('archived_at')} (hidden from lists)"))
    if job.get("rerun_of"):
        rows.append(("re-run of", str(job["rerun_of"])))
    if job.get("notes"):
        rows.append(("notes", str(job["notes"])))
    return rows


def _progress_short(job: dict) -> str:
    p = job.get("progress") or {}
    if p.get("step") is None:
        return "-"
    total = p.get("total_steps")
    pct = f" ({100 * p['step'] / total:.0f}%)" if total else ""
    return f"{p['step']}/{total or '?'}{pct}"


def _progress_long(job: dict) -> str:
    p = job.get("progress") or {}
    parts = []
    if p.get("epoch") is not None:
        parts.append(f"epoch {num(p['epoch'])}")
    parts.append(f"step {_progress_short(job)}")
    if p.get("samples_per_s"):
        parts.append(f"{p['samples_per_s']:,.0f} samples/s")
    if p.get("eta_s") is not None and job.get("state") not in TERMINAL_STATES:
        parts.append(f"ETA {render.human_duration(p['eta_s'])}")
    return ", ".join(parts)


def _metric_value(v: Any) -> str:
    if isinstance(v, dict):
        v = v.get("value")
    return render.fmt_value(v) if isinstance(v, int | float) else str(v)
