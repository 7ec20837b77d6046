"""The client half of the `torchyard` command: submit, status, list, cancel, logs, metrics,
download, workers. `main(argv)` takes the command name as argv[0].

Exit codes: 0 success; 1 a failure (server unreachable, job failed or cancelled, not found);
2 bad input (a spec the server rejected, an unreadable spec file, a wrong option);
130 interrupted. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import csv
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

from torchyard.client import render
from torchyard.client.errors import (
    APIError,
    ConnectError,
    NotFound,
    TorchyardError,
    Unavailable,
)
from torchyard.client.sdk import TERMINAL_STATES, Client, Download, load_spec

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
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
        with Client(
            args.url, args.token, timeout=args.timeout, transport=transport, http=http
        ) as client:
            return int(args.run(client, args) or EXIT_OK)
    except TorchyardError as e:
        _err(str(e) if not isinstance(e, APIError) else e.one_line())
        return EXIT_USAGE if e.is_user_error else EXIT_FAIL
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `torchyard metrics … | head`
        return EXIT_OK


_JOB_HELP = "job id (or a unique prefix)"
_INTERVAL_HELP = "--follow: at most one refresh of the job's progress per this many seconds"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection")
    g.add_argument("--url", help="API URL (default: $TORCHYARD_URL, else http://127.0.0.1:8000)")
    g.add_argument(
        "--token", help="API token (default: $TORCHYARD_TOKEN, else $TORCHYARD_HOME/admin-token)"
    )
    g.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")

    p = argparse.ArgumentParser(prog="torchyard", description="torchyard client")
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
    return p


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
    sp.add_argument("--state", help="only jobs in this state (queued, running, succeeded, …)")
    sp.add_argument("-n", "--limit", type=int, default=20, help="how many (default 20)")
    sp.add_argument("--json", action="store_true", help="print the jobs as JSON")

    sp = cmd("cancel", cmd_cancel, "cancel a job (idempotent)")
    sp.add_argument("job", help=_JOB_HELP)

    sp = cmd("logs", cmd_logs, "print a job's output (the trainer's stdout and stderr)")
    sp.add_argument("job", help=_JOB_HELP)
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    sp.add_argument("--offset", type=int, default=0, help="start at this byte")


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
    if not args.follow:
        return EXIT_OK
    return follow_job(client, job["id"], interval_s=args.interval)


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    job_id = resolve_job_id(client, args.job)
    if args.follow:
        return follow_job(client, job_id, interval_s=args.interval)
    job = client.job(job_id)
    if args.json:
        _print_json(job)
    else:
        _print(describe_job(job))
    return EXIT_OK


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    jobs: list[dict] = []
    for job in client.iter_jobs(state=args.state, page_size=min(max(args.limit, 1), 100)):
        jobs.append(job)
        if len(jobs) >= args.limit:
            break
    if args.json:
        _print_json(jobs)
        return EXIT_OK
    if not jobs:
        print("no jobs" + (f" in state {args.state}" if args.state else ""))
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


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    job_id = resolve_job_id(client, args.job)
    job = client.cancel(job_id) or {}
    state = job.get("state") if isinstance(job, dict) else None
    print(f"cancel requested for {job_id}" + (f" (now {state})" if state else ""))
    return EXIT_OK


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    job_id = resolve_job_id(client, args.job)
    out = sys.stdout
    if args.follow:
        for text in client.follow_logs(job_id, offset=args.offset):
            out.write(text)
            out.flush()
        return EXIT_OK
    offset = args.offset
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
    job_id = resolve_job_id(client, args.job)
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
    job_id = resolve_job_id(client, args.job)
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
        _err(f"stopped following; the job goes on (torchyard status {job_id})")
        return EXIT_INTERRUPTED


class _Follower:
    """--follow, fed by GET /v1/jobs/{id}/events: state lines as the job moves, a live
    progress line from the metric events. The job itself (progress totals, ETA, pending
    reason) is read on each state change and at most once per `refresh_s` while metrics
    flow, never polled on a timer."""

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
        if self.state in ("running", "cancelling"):
            self.status.update(progress_line(self.shown(), self.latest))


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
            "  from safetensors.torch import load_file",
            f"  state_dict = load_file({path})",
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


def resolve_job_id(client: Client, ref: str) -> str:
    """A full id as is; otherwise the one job whose id starts with `ref`."""
    if _FULL_ID.match(ref):
        return ref
    if not re.fullmatch(r"[0-9a-f]{1,31}", ref):
        raise NotFound(404, "not_found", f"not a job id: {ref!r}")
    matches = []
    for i, job in enumerate(client.iter_jobs(page_size=100)):
        if job["id"].startswith(ref):
            matches.append(job["id"])
        if i >= 1000 or len(matches) > 1:
            break
    if len(matches) == 1:
        return matches[0]
    msg = f"no job id starts with {ref}" if not matches else f"{ref} matches several jobs"
    raise NotFound(404, "not_found", msg)


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


def _err(msg: str) -> None:
    first, *rest = str(msg).splitlines() or [""]
    print(f"error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
