"""The client half of the `torchyard` command: submit, status, list, cancel, logs, metrics,
download, workers, quota, queue, sweep, login. `main(argv)` takes the command name as argv[0].
The server's URL and token are looked up as client/config.py says.

Exit codes: 0 success (a cancel that finds the job ended too); 1 a failure (server
unreachable, token refused, job failed or cancelled, not found, over a quota); 2 bad input (a
spec the server rejected, an unreadable spec or login file, a wrong option, an ambiguous id
prefix); 130 interrupted (a note, not an error). Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import csv
import getpass
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx
from rich.console import Group, RenderableType

from torchyard.client import config, render
from torchyard.client.config import LOOKUP_ORDER, resolve
from torchyard.client.errors import (
    APIError,
    Conflict,
    ConnectError,
    NotFound,
    TorchyardError,
    Unavailable,
)
from torchyard.client.sdk import TERMINAL_STATES, Client, Download, load_spec, match_prefix
from torchyard.client.specfile import print_warnings

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_MAX_PAGE = 500  # the most jobs GET /v1/jobs answers with at once
_FULL_ID = re.compile(r"^[0-9a-f]{32}$")
# How long --follow keeps retrying while the API is unreachable (e.g. `up` restarting).
RECONNECT_FOR_S = 180.0
# A table longer than this is downsampled by the server: rich lays a table out cell by cell
# (about 2 ms a row), and nobody reads ten thousand rows on a terminal (--csv has them all).
TABLE_MAX_ROWS = 1000


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
        _err(str(e) if not isinstance(e, APIError) else e.one_line())
        return EXIT_USAGE if e.is_user_error else EXIT_FAIL
    except KeyboardInterrupt:  # Ctrl-C is the user's choice, not an error
        _note("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `torchyard metrics … | head`
        return EXIT_OK


_JOB_HELP = "job id (or a unique prefix)"
_CONNECTION_HELP = f"URL and token, first found: {LOOKUP_ORDER}"
_INTERVAL_HELP = "--follow: at most one refresh of the job's progress per this many seconds"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection", _CONNECTION_HELP)
    g.add_argument("--url", help="API URL")
    g.add_argument("--token", help="API token (`torchyard token create` makes one)")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")

    p = argparse.ArgumentParser(
        prog="torchyard", description="torchyard client", epilog=_CONNECTION_HELP
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    def cmd(name: str, fn: Callable[[Client, argparse.Namespace], int], help: str) -> Any:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(run=fn)
        return sp

    _add_job_commands(cmd)
    _add_metrics_command(
        cmd("metrics", cmd_metrics, "show a job's metrics as a table, CSV or a plot")
    )
    sp = cmd("download", cmd_download, "download a checkpoint, resumable, sha256-verified")
    sp.add_argument("job", help=_JOB_HELP)
    sp.add_argument(
        "-c", "--checkpoint", default="latest", help="checkpoint id or `latest` (default)"
    )
    sp.add_argument("-o", "--output", help="file or directory to write (default: ./<job>-step<N>)")
    sp = cmd("workers", cmd_workers, "list workers: host, GPU, state, current job, heartbeat")
    sp.add_argument("--json", action="store_true", help="print the workers as JSON")
    _add_pool_commands(sub, common)
    _add_sweep_commands(sub, common)
    _add_login_command(sub)
    return p


def _add_login_command(sub: Any) -> None:
    what = (
        "check a server's URL and token and save them for every torchyard command, from any "
        f"directory: in {config.config_path()} (mode 0600)"
    )
    sp = sub.add_parser("login", help="save a server's URL and token", description=what)
    sp.set_defaults(run=cmd_login)
    sp.add_argument("url", help="the API's URL, e.g. http://gpu-host:8000")
    sp.add_argument(
        "--token",
        help="API token (`torchyard token create --user NAME` on the server makes one); "
        "default: $TORCHYARD_TOKEN, a token saved for this URL, else asked for",
    )
    sp.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")


def _add_job_commands(cmd: Callable[..., Any]) -> None:
    """submit, status, list, cancel and logs."""
    sp = cmd("submit", cmd_submit, "submit a job spec (JSON or YAML); prints the job id")
    sp.add_argument("spec", help="path to the spec file (.json, .yaml or .yml)")
    sp.add_argument(
        "--code",
        metavar="DIR",
        help="run the job with the code in DIR: packed into a bundle (honouring "
        ".torchyardignore), uploaded unless the server has it already, set as code.bundle",
    )
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--idempotency-key", help="retrying with the same key returns the same job")
    sp.add_argument("--interval", type=float, default=0.5, help=_INTERVAL_HELP)
    sp.add_argument("--json", action="store_true", help="print the created job as JSON")

    sp = cmd("status", cmd_status, "show a job: state, progress, latest metrics, attempts")
    sp.add_argument("job", help=_JOB_HELP)
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
    sp.add_argument("--json", action="store_true", help="print the jobs as JSON")

    sp = cmd("cancel", cmd_cancel, "cancel a job (idempotent)")
    sp.add_argument("job", help=_JOB_HELP)

    sp = cmd("logs", cmd_logs, "print a job's output (the trainer's stdout and stderr)")
    sp.add_argument("job", help=_JOB_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    start = sp.add_mutually_exclusive_group()
    start.add_argument("--offset", type=int, default=0, help="start at this byte")
    start.add_argument("-n", "--tail", type=int, metavar="N", help="start at the last N lines")


def _add_metrics_command(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("job", help=_JOB_HELP)
    sp.add_argument(
        "--name", action="append", help="only this series (repeatable), e.g. --name val/loss"
    )
    out = sp.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="CSV: step, then one column per series")
    out.add_argument("--plot", action="store_true", help="draw the loss curves in the terminal")
    sp.add_argument("--max-points", type=int, help="downsample each series on the server")
    sp.add_argument("--log", action="store_true", help="--plot with a logarithmic y axis")
    sp.add_argument("--width", type=int, default=72, help="--plot width in characters")
    sp.add_argument("--height", type=int, default=18, help="--plot height in lines")


# -- commands ----------------------------------------------------------------------------------


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    job = client.submit(spec, code=args.code, idempotency_key=args.idempotency_key)
    if args.json:
        _print_json(job)
    else:
        print(job["id"], flush=True)
    print_warnings(job)  # stderr: the job is stored all the same
    if not args.follow:
        return EXIT_OK
    return follow_job(client, job["id"], interval_s=args.interval)


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    if args.follow:
        return follow_job(client, job_id, interval_s=args.interval)
    job = client.job(job_id)
    if args.json:
        _print_json(job)
    else:
        _print(describe_job(job))
    return EXIT_OK


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    jobs, cursor = _list_pages(client, args)
    if cursor:  # stderr: stdout stays the table (or the JSON) alone
        again = "".join(f" --state {s}" for s in args.state or [])
        print(
            f"… more jobs: torchyard list{again} -n {args.limit} --cursor {cursor} "
            "(or --all for every one)",
            file=sys.stderr,
        )
    if args.json:
        _print_json(jobs)
        return EXIT_OK
    if not jobs:
        states = " or ".join(args.state or [])
        print("no jobs" + (f" in state {states}" if states else ""))
        return EXIT_OK
    rows = [
        (
            j["id"][:12],
            j.get("name"),
            j.get("state"),
            j.get("attempt"),
            _progress_short(j),
            _age(j.get("created_at")),
        )
        for j in jobs
    ]
    _print(render.table(["ID", "NAME", "STATE", "ATTEMPT", "PROGRESS", "CREATED"], rows))
    return EXIT_OK


def _list_pages(client: Client, args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """Up to -n jobs (every one with --all) and the cursor after the last, when more exist.
    Each page asks for just what is missing, so the server's cursor is exactly there."""
    jobs: list[dict] = []
    cursor = args.cursor
    while args.all or len(jobs) < args.limit:
        want = _MAX_PAGE if args.all else min(args.limit - len(jobs), _MAX_PAGE)
        page = client.jobs(state=args.state, limit=want, cursor=cursor)
        jobs += page.get("items", [])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return jobs, cursor


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 whenever the job no longer runs: cancelled now, before, or already ended (a
    cancel that finds nothing to stop has still got what it asked for)."""
    job_id = client.resolve_job_id(args.job)
    try:
        job = client.cancel(job_id) or {}
    except Conflict as e:
        state = e.details.get("state") if isinstance(e.details, dict) else None
        if state not in TERMINAL_STATES:
            raise
        print(f"job {job_id} already {state}: nothing to cancel")
        return EXIT_OK
    state = job.get("state") if isinstance(job, dict) else None
    print(f"cancel requested for {job_id}" + (f" (now {state})" if state else ""))
    return EXIT_OK


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    out = sys.stdout
    offset = args.offset
    if args.tail is not None:
        tail = client.log_tail(job_id, args.tail)
        out.write(tail["data"])
        out.flush()
        if not args.follow:
            return EXIT_OK
        offset = tail["next_offset"]
    if args.follow:
        try:
            for text in client.follow_logs(job_id, offset=offset):
                out.write(text)
                out.flush()
        except KeyboardInterrupt:
            _note(f"stopped following the log; the job goes on (torchyard status {job_id})")
            return EXIT_INTERRUPTED
        return EXIT_OK
    while True:  # the whole log, window by window
        chunk = client.logs(job_id, offset=offset)
        out.write(chunk.get("data") or "")
        nxt = int(chunk.get("next_offset", offset))
        if nxt <= offset or nxt >= int(chunk.get("size", nxt)):
            break
        offset = nxt
    out.flush()
    return EXIT_OK


def cmd_metrics(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    max_points = args.max_points
    if args.plot and max_points is None:
        max_points = max(args.width * 2, 50)
    series = client.metrics(job_id, name=args.name, max_points=max_points)
    if not series:
        _err(f"no metrics yet for job {job_id}")
        return EXIT_FAIL
    if args.csv:
        write_csv(series, sys.stdout)
    elif args.plot:
        names = args.name or [n for n in series if "loss" in n] or list(series)
        data = {n: (series[n]["steps"], series[n]["values"]) for n in names if n in series}
        color = render.colour(render.console(sys.stdout))
        print(render.plot(data, width=args.width, height=args.height, color=color, log_y=args.log))
    else:
        names, rows = wide_rows(series)
        if len(rows) > TABLE_MAX_ROWS and max_points is None:
            series = client.metrics(job_id, name=args.name, max_points=TABLE_MAX_ROWS)
            names, rows = wide_rows(series)
            print(
                f"note: {TABLE_MAX_ROWS} rows at most in a table: each row is the last point "
                "of its span of steps; --csv gives every point",
                file=sys.stderr,
            )
        _print(render.table(["step", *names], rows))
    return EXIT_OK


def cmd_download(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    transfer = render.Transfer(sys.stderr)
    dl = client.download(job_id, args.checkpoint, args.output, on_progress=transfer)
    transfer.done(dl.bytes)
    print(describe_download(dl))
    return EXIT_OK


def cmd_workers(client: Client, args: argparse.Namespace) -> int:
    workers = client.workers()
    if args.json:
        _print_json(workers)
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
            _age(w.get("last_heartbeat")),
        )
        for w in workers
    ]
    _print(render.table(["ID", "HOST", "PID", "GPU", "STATE", "JOB", "HEARTBEAT"], rows))
    return EXIT_OK


def cmd_login(client: Client, args: argparse.Namespace) -> int:
    """Check the URL and token with an authenticated request, then save both. Nothing is
    saved when either is wrong."""
    if client.token is None:
        token = _ask_token(client.url)
        if not token:
            _err(
                f"no token for {client.url}: give --token T or set TORCHYARD_TOKEN "
                "(`torchyard token create --user NAME` on the server makes one)"
            )
            return EXIT_USAGE
        client.use_token(token)
    try:
        user = client.get_quota("me").get("user")
    except NotFound:
        _err(f"{client.url} answers, but not as a torchyard API (404 for /v1/users/me/quota)")
        return EXIT_FAIL
    except TorchyardError as e:
        _err(f"{e.one_line() if isinstance(e, APIError) else e}; nothing was saved")
        return EXIT_FAIL
    assert client.token is not None
    path = config.save(client.url, client.token, saved_by="login")
    print(f"logged in to {client.url} as {user} (token from {client.connection.token_from})")
    print(f"saved the URL and token in {path} (mode 0600); every torchyard command uses them")
    print("from any directory unless --url/--token or TORCHYARD_URL/TORCHYARD_TOKEN are given")
    return EXIT_OK


def _ask_token(url: str) -> str | None:
    """The token, typed without echo, when a person is at the terminal."""
    if not sys.stdin.isatty():
        return None
    return getpass.getpass(f"token for {url}: ").strip() or None


# -- the pool: quotas and the queue ----------------------------------------------------------------

_QUOTA_FIELDS = ("max_workers", "max_queued", "share")
_NO_LIMIT = ("none", "unlimited")


def _add_pool_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """quota set, quota show and queue. The connection options belong to the innermost
    parser only: argparse lets a subcommand's defaults overwrite what its parent parsed."""
    quota = sub.add_parser("quota", help="show or set a user's quota (setting: admins)")
    actions = quota.add_subparsers(dest="quota_command", required=True, metavar="action")
    sp = actions.add_parser(
        "set",
        parents=[common],
        help="change a user's quota (admins); options not given are left as they are",
        description="change a user's quota (admins); options not given are left as they are",
    )
    sp.set_defaults(run=cmd_quota_set)
    sp.add_argument("user", help="user name")
    unset = {"default": argparse.SUPPRESS, "metavar": "N|none"}  # absent: left as it is
    limit = "most workers the user's jobs hold at once (none: no limit)"
    sp.add_argument("--max-workers", type=_limit, help=limit, **unset)
    queued = "most queued jobs the user may have; a submit over it is refused (none: no limit)"
    sp.add_argument("--max-queued", type=_limit, help=queued, **unset)
    share = "fair-share weight, > 0: 2 may use twice as much (none: back to 1)"
    sp.add_argument("--share", type=_share, help=share, **unset | {"metavar": "S|none"})
    sp.add_argument("--json", action="store_true", help="print the quota as JSON")
    sp = actions.add_parser(
        "show",
        parents=[common],
        help="show a user's quota (default: yours)",
        description="show a user's quota (default: yours; another user's: admins)",
    )
    sp.set_defaults(run=cmd_quota_show)
    sp.add_argument("user", nargs="?", help="user name (default: yourself; others: admins)")
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


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1: {value!r}")
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


def cmd_quota_set(client: Client, args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in _QUOTA_FIELDS if hasattr(args, k)}
    if not fields:
        _err("nothing to set: give --max-workers, --max-queued and/or --share")
        return EXIT_USAGE
    _show_quota(client.set_quota(args.user, **fields), args.json)
    return EXIT_OK


def cmd_quota_show(client: Client, args: argparse.Namespace) -> int:
    _show_quota(client.get_quota(args.user or "me"), args.json)
    return EXIT_OK


def _show_quota(quota: dict, as_json: bool) -> None:
    if as_json:
        _print_json(quota)
        return
    rows = [("user", str(quota.get("user")))]
    for key in ("max_workers", "max_queued"):
        rows.append((key, "no limit" if quota.get(key) is None else str(quota[key])))
    rows.append(("share", _num(quota.get("share"))))
    _print(render.fields(rows))


def cmd_queue(client: Client, args: argparse.Namespace) -> int:
    q = client.queue(limit=max(args.limit, 1))
    if args.json:
        _print_json(q)
        return EXIT_OK
    _print(describe_queue(q, args.limit))
    return EXIT_OK


def describe_queue(q: dict, limit: int | None = None) -> RenderableType:
    """The queue as a table, then each user's usage and limits."""
    counts, items, unit = q.get("counts") or {}, q.get("items") or [], q.get("unit") or "worker"
    head = (
        f"{counts.get('queued', 0)} queued jobs from {counts.get('users', 0)} users, "
        f"{counts.get('mine', 0)} of them yours"
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
        rows = [
            (name, f"{u.get('worker_hours') or 0:.2f}", u.get("share"),
             _or_none(u.get("max_workers")), _or_none(u.get("max_queued")))
            for name, u in usage.items()
        ]  # fmt: skip
        parts += [
            "",
            f"usage ({unit}-hours, half-life {_half_life(q.get('half_life_s'))}; fair share "
            "orders users by usage / share):",
            render.table(["USER", f"{unit.upper()}-H", "SHARE", "MAX WORKERS", "MAX QUEUED"], rows),
        ]
    return Group(*parts)


def _or_none(v: Any) -> Any:
    return "no limit" if v is None else v


def _half_life(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    days = seconds / 86_400
    if days >= 1 and days.is_integer():
        return f"{days:g} day" + ("s" if days > 1 else "")
    return f"{seconds / 3600:g} h"


# -- following a job ----------------------------------------------------------------------------


def follow_job(
    client: Client, job_id: str, *, interval_s: float = 0.5, stream: TextIO | None = None
) -> int:
    """Draw the job's progress and latest metrics from its event stream until it ends.
    Survives the API going away for a while (an `up` restart): the stream resumes where it
    broke. Exit 0 if it succeeded, 1 if it failed or was cancelled."""
    status = render.Status(stream or sys.stderr)
    try:
        return _Follower(client, job_id, status, interval_s).run()
    except KeyboardInterrupt:
        status.done()
        _note(f"stopped following; the job goes on (torchyard status {job_id})")
        return EXIT_INTERRUPTED


class _Follower:
    """--follow, fed by GET /v1/jobs/{id}/events: state lines as the job moves, a live
    progress line from the metric events. The job itself (progress totals, ETA, pending
    reason) is read on each state change and at most once per `refresh_s` while metrics
    flow, never polled on a timer; a queued job's new pending reasons come as `status`
    events."""

    def __init__(self, client: Client, job_id: str, status: render.Status, refresh_s: float):
        self.client, self.job_id, self.status, self.refresh_s = client, job_id, status, refresh_s
        self.job: dict = {}
        self.state: str | None = None
        self.latest: dict[str, tuple[int, float]] = {}
        self.step: int | None = None
        self.epoch: Any = None
        self.said: tuple[Any, ...] = ()
        self.refreshed_at = -math.inf

    def run(self) -> int:
        self.refresh()
        events = self.client.stream_events(
            self.job_id, reconnect_for_s=RECONNECT_FOR_S, on_retry=self.lost
        )
        for ev in events:
            if ev.event == "state":
                self.on_state(ev.data)
            elif ev.event == "metric":
                self.on_metric(ev.data)
            elif ev.event == "status":
                self.on_status(ev.data)
            elif ev.event == "end":
                self.state = ev.data.get("state") or self.state
        self.refresh(strict=False)
        self.status.done(progress_line(self.shown(), self.latest) if self.latest else None)
        self.status.message(summary_line(self.shown(), self.latest))
        return EXIT_OK if self.state == "succeeded" else EXIT_FAIL

    def refresh(self, *, strict: bool = True) -> None:
        """Read the job. Only the first read must succeed (a wrong URL or id fails at once);
        later, an API that is away keeps the last copy while the stream reconnects."""
        try:
            self.job = self.client.job(self.job_id)
        except (ConnectError, Unavailable):
            if strict:
                raise
        self.refreshed_at = time.monotonic()

    def on_state(self, data: dict) -> None:
        self.state = data.get("state")
        self.refresh(strict=False)
        shown = {**self.job, "state": self.state}
        shown["attempt"] = data.get("attempt") or self.job.get("attempt")
        if self.job.get("state") != self.state:  # an old event, replayed: no current reason
            shown["pending_reason"] = None
        now_said = (self.state, shown["attempt"])
        if now_said != self.said:
            self.status.message(_state_line(shown))
            self.said = now_said
        self.draw()

    def on_status(self, data: dict) -> None:
        """A queued job's pending reason changed (the scheduler's view of why it waits)."""
        reason = data.get("pending_reason")
        if self.state != "queued" or not reason or reason == self.job.get("pending_reason"):
            return
        self.job["pending_reason"] = reason
        self.status.message(_state_line({**self.job, "state": self.state}))

    def on_metric(self, data: dict) -> None:
        name, step, value = data.get("name"), int(data.get("step", 0)), data.get("value")
        if name and (name not in self.latest or step >= self.latest[name][0]):
            self.latest[name] = (step, value)
        if self.step is None or step >= self.step:
            self.step, self.epoch = step, data.get("epoch", self.epoch)
        if time.monotonic() - self.refreshed_at >= self.refresh_s:
            self.refresh(strict=False)
        self.draw()

    def lost(self, e: TorchyardError) -> None:
        self.status.update(f"API unreachable, retrying… ({str(e).split(';')[0]})")

    def shown(self) -> dict:
        """The job as last read, its progress moved on by the metric events since."""
        progress = dict(self.job.get("progress") or {})
        if self.step is not None and self.step >= (progress.get("step") or 0):
            progress["step"] = self.step
            if self.epoch is not None:
                progress["epoch"] = self.epoch
        return {**self.job, "state": self.state or self.job.get("state"), "progress": progress}

    def draw(self) -> None:
        # Not before the first step is known: a plain-text log's first line would be a bar
        # with neither epoch nor step, and it is the one line shown for several seconds.
        shown = self.shown()
        if self.state in ("running", "cancelling") and shown["progress"].get("step") is not None:
            self.status.update(progress_line(shown, self.latest))


def _state_line(job: dict) -> str:
    state, attempt = job.get("state"), job.get("attempt")
    text = f"{job.get('id', '')[:12]} {state}"
    if attempt and attempt > 1:
        text += f" (attempt {attempt})"
    if state == "queued" and job.get("pending_reason"):
        text += f": {job['pending_reason']}"
    return text


SHOWN_METRICS = ("train/loss", "val/loss", "val/accuracy")


def progress_line(job: dict, latest: dict[str, tuple[int, float]]) -> RenderableType:
    p = job.get("progress") or {}
    spec = job.get("spec") or {}
    step, total = p.get("step"), p.get("total_steps")
    parts: list[RenderableType] = []
    if p.get("epoch") is not None:
        epochs = spec.get("epochs")
        parts.append(f"epoch {_num(p['epoch'])}" + (f"/{epochs}" if epochs else ""))
    parts.append(render.bar(step, total))
    if step is not None:
        parts.append(f"{step}/{total if total else '?'}")
    if p.get("samples_per_s"):
        parts.append(f"{p['samples_per_s']:,.0f} samples/s")
    done = step is not None and bool(total) and step >= total
    if job.get("state") not in TERMINAL_STATES and not done:
        parts.append(f"ETA {render.human_duration(p.get('eta_s'))}")
    for name in SHOWN_METRICS:
        if name in latest:
            parts.append(f"{name} {render.fmt_value(latest[name][1])}")
    return render.line(parts)


def summary_line(job: dict, latest: dict[str, tuple[int, float]]) -> str:
    state = job.get("state")
    took = _duration(job.get("created_at"), job.get("finished_at"))
    text = f"job {job.get('id')} {state}" + (f" in {took}" if took else "")
    shown = [f"{n} {render.fmt_value(latest[n][1])}" for n in SHOWN_METRICS if n in latest]
    if shown:
        text += " — " + ", ".join(shown)
    if state == "failed" and job.get("error"):
        text += f"\nerror: {job['error']}"
    if state == "succeeded":
        text += (
            f"\n  torchyard metrics {job.get('id')} --plot\n  torchyard download {job.get('id')}"
        )
    return text


# -- sweeps ----------------------------------------------------------------------------------------

_SWEEP_HELP = "sweep id (or a unique prefix)"
_SWEEP_FOLLOW = "show the trials, best first, until the sweep ends"
_SWEEP_INTERVAL = "--follow: seconds between reads of the sweep (default 2)"


def _add_sweep_commands(sub: Any, common: argparse.ArgumentParser) -> None:
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
    sweep = client.create_sweep(load_spec(args.file))
    if args.json:
        _print_json(sweep)
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
        _print_json(sweep)
    else:
        _print(describe_sweep(sweep))
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
        _print_json(sweeps)
    elif not sweeps:
        print("no sweeps" + (f" in state {args.state}" if args.state else ""))
    else:
        rows = [
            (
                s["id"][:12],
                s.get("name"),
                s.get("state"),
                _trials_done(s),
                _best_short(s),
                _age(s.get("created_at")),
            )
            for s in sweeps
        ]
        _print(render.table(["ID", "NAME", "STATE", "TRIALS", "BEST", "CREATED"], rows))
    return EXIT_OK


def cmd_sweep_cancel(client: Client, args: argparse.Namespace) -> int:
    sweep_id = resolve_sweep_id(client, args.sweep)
    state = (client.cancel_sweep(sweep_id) or {}).get("state")
    print(f"cancel requested for sweep {sweep_id}" + (f" (now {state})" if state else ""))
    return EXIT_OK


def follow_sweep(
    client: Client, sweep_id: str, *, interval_s: float = 2.0, stream: TextIO | None = None
) -> int:
    """A live table of the sweep's trials, best first, redrawn until the sweep has ended and
    its trials have stopped. Keeps retrying while the API is away. Exit 0 if it succeeded,
    1 if it failed or was cancelled."""
    status = render.Status(stream or sys.stderr)
    sweep, lost_since = client.get_sweep(sweep_id), None
    try:
        while sweep.get("state") == "running" or (sweep.get("counts") or {}).get("running"):
            status.update(describe_sweep(sweep))
            time.sleep(interval_s)
            try:
                sweep, lost_since = client.get_sweep(sweep_id), None
            except (ConnectError, Unavailable) as e:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_FOR_S:
                    raise
                status.update(f"API unreachable, retrying… ({str(e).split(';')[0]})")
    except KeyboardInterrupt:
        status.done()
        _note(f"stopped following; the sweep goes on (torchyard sweep status {sweep_id})")
        return EXIT_INTERRUPTED
    status.done(describe_sweep(sweep))
    status.message(sweep_summary_line(sweep))
    return EXIT_OK if sweep.get("state") == "succeeded" else EXIT_FAIL


def describe_sweep(sweep: dict) -> RenderableType:
    """The sweep's fields, then its trials sorted by value, best first (unscored last)."""
    obj = sweep.get("objective") or {}
    rows = [
        ("id", str(sweep.get("id"))),
        ("name", str(sweep.get("name"))),
        ("state", str(sweep.get("state"))),
        ("objective", f"{obj.get('mode')} {obj.get('metric')}"),
        (
            "search",
            f"{sweep.get('sampler')} sampler, pruner {sweep.get('pruner')}, "
            f"{sweep.get('parallel')} at once",
        ),
        ("trials", _trials_done(sweep)),
        ("best", _best_short(sweep)),
    ]
    if sweep.get("error"):
        rows.append(("error", str(sweep["error"])))
    trials = sweep.get("trials") or []
    if not trials:
        return render.fields(rows)
    names = sorted({k for t in trials for k in t.get("params") or {}})
    sign = -1.0 if obj.get("mode") == "max" else 1.0
    ordered = sorted(trials, key=lambda t: (t.get("value") is None, sign * (t.get("value") or 0)))
    table_rows = [
        (
            t.get("number"),
            (t.get("job_id") or "-")[:12],
            _trial_state(t),
            t.get("value"),
            t.get("step"),
            *(_param(t["params"].get(n)) for n in names),
        )
        for t in ordered
    ]
    headers = ["#", "JOB", "STATE", obj.get("metric") or "VALUE", "STEP", *names]
    return Group(render.fields(rows), "", render.table(headers, table_rows))


def sweep_summary_line(sweep: dict) -> str:
    text = f"sweep {sweep.get('id')} {sweep.get('state')} — {_trials_done(sweep)}"
    best = sweep.get("best")
    if best:
        params = ", ".join(f"{k}={_param(v)}" for k, v in (best.get("params") or {}).items())
        metric = (sweep.get("objective") or {}).get("metric")
        text += (
            f"\nbest {metric} {render.fmt_value(best.get('value'))}: trial "
            f"{best.get('number')}, job {best.get('job_id')} ({params})"
        )
    return text


def _trial_state(t: dict) -> str:
    status = t.get("status")
    return str(t.get("state")) if status in (None, "running") else str(status)


def _trials_done(sweep: dict) -> str:
    counts = sweep.get("counts") or {}
    done = sum(v for k, v in counts.items() if k != "running")
    parts = [
        f"{counts[k]} {k}" for k in ("running", "complete", "pruned", "failed") if counts.get(k)
    ]
    return f"{done}/{sweep.get('max_trials')} done" + (f" ({', '.join(parts)})" if parts else "")


def _best_short(sweep: dict) -> str:
    best = sweep.get("best")
    if not best:
        return "-"
    return f"{render.fmt_value(best.get('value'))} (trial {best.get('number')})"


def _param(v: Any) -> str:
    if isinstance(v, float):
        return render.fmt_value(v)
    return json.dumps(v) if isinstance(v, list | dict) else str(v)


def resolve_sweep_id(client: Client, ref: str) -> str:
    """A full id as is; otherwise the one sweep among the newest 500 whose id starts with
    `ref` (several: AmbiguousId naming them)."""
    if _FULL_ID.match(ref):
        return ref
    if not re.fullmatch(r"[0-9a-f]{1,31}", ref):
        raise NotFound(404, "not_found", f"not a sweep id: {ref!r}")
    return match_prefix("sweep", ref, client.list_sweeps(limit=500).get("items", []), 500)


# -- descriptions ---------------------------------------------------------------------------------


def describe_job(job: dict) -> RenderableType:
    rows: list[tuple[str, str]] = [
        ("id", str(job.get("id"))),
        ("name", str(job.get("name"))),
        ("state", f"{job.get('state')} (attempt {job.get('attempt')})"),
    ]
    if job.get("pending_reason") and job.get("state") == "queued":
        rows.append(("waiting", str(job["pending_reason"])))
    if job.get("progress"):
        rows.append(("progress", _progress_long(job)))
    if job.get("error"):
        rows.append(("error", str(job["error"])))
    for key in ("created_at", "started_at", "finished_at"):
        if job.get(key):
            rows.append((key.removesuffix("_at"), f"{job[key]} ({_age(job[key])} ago)"))
    lm = job.get("latest_metrics") or {}
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


def describe_download(dl: Download) -> str:
    ck = dl.checkpoint
    lines = [
        f"saved {dl.path} ({render.human_bytes(dl.bytes)}, checkpoint {ck.get('id')} "
        f"at step {ck.get('step')})",
        f"sha256 {dl.sha256} verified"
        + (f"; resumed after {render.human_bytes(dl.resumed_from)}" if dl.resumed_from else ""),
        "load it with:",
    ]
    path = json.dumps(str(dl.path))
    if dl.format == "safetensors":
        lines += [
            "  import torchyard",
            f"  model = torchyard.load_model({path})  # eval mode; add code=DIR for a bundle's model",
            "  logits = model(x)  # x as the data set's files hold it (uint8 pixels, digits 0..16)",
            "  # or the bare tensors: safetensors.torch.load_file(path)",
        ]
    else:
        lines += [
            "  import torch",
            f'  ckpt = torch.load({path}, map_location="cpu", weights_only=True)',
            "  # ckpt['model'] is the model's state_dict",
        ]
    return "\n".join(lines)


def write_csv(series: dict[str, dict[str, list]], out: TextIO) -> None:
    names, rows = wide_rows(series)
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["step", *names])
    for r in rows:
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in r])


def wide_rows(series: dict[str, dict[str, list]]) -> tuple[list[str], list[list[Any]]]:
    """One row per step, one column per series (None where a series has no value there)."""
    names = sorted(series)
    by_step: dict[int, dict[str, float]] = {}
    for n in names:
        for s, v in zip(series[n].get("steps", []), series[n].get("values", []), strict=False):
            by_step.setdefault(int(s), {})[n] = v
    return names, [[s] + [by_step[s].get(n) for n in names] for s in sorted(by_step)]


# -- helpers ------------------------------------------------------------------------------------


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
        parts.append(f"epoch {_num(p['epoch'])}")
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


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _age(value: Any) -> str:
    t = _parse_time(value)
    if t is None:
        return "-"
    return render.human_age((datetime.now(UTC) - t).total_seconds())


def _duration(start: Any, end: Any) -> str | None:
    a, b = _parse_time(start), _parse_time(end)
    return render.human_duration((b - a).total_seconds()) if a and b else None


def _print(renderable: RenderableType) -> None:
    render.show(renderable, sys.stdout)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _note(msg: str) -> None:
    """A line on stderr that is no error (Ctrl-C on --follow is a normal way to stop)."""
    print(msg, file=sys.stderr)


def _err(msg: str) -> None:
    first, *rest = str(msg).splitlines() or [""]
    print(f"error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
