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
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx

from torchyard.client import render
from torchyard.client.errors import APIError, ConnectError, NotFound, TorchyardError
from torchyard.client.sdk import TERMINAL_STATES, Client, Download, load_spec

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_FULL_ID = re.compile(r"^[0-9a-f]{32}$")
# How long --follow keeps retrying while the API is unreachable (e.g. `up` restarting).
RECONNECT_FOR_S = 180.0


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run one client command; `transport` replaces the network (tests pass
    httpx.MockTransport)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line complaint and usage
        return EXIT_OK if e.code in (0, None) else EXIT_USAGE
    try:
        with Client(args.url, args.token, timeout=args.timeout, transport=transport) as client:
            return int(args.run(client, args) or EXIT_OK)
    except TorchyardError as e:
        _err(str(e) if not isinstance(e, APIError) else e.one_line())
        return EXIT_USAGE if e.is_user_error else EXIT_FAIL
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `torchyard metrics … | head`
        return EXIT_OK


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

    sp = cmd("submit", cmd_submit, "submit a job spec (JSON or YAML); prints the job id")
    sp.add_argument("spec", help="path to the spec file (.json, .yaml or .yml)")
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--idempotency-key", help="retrying with the same key returns the same job")
    sp.add_argument("--interval", type=float, default=0.5, help="--follow: seconds between polls")
    sp.add_argument("--json", action="store_true", help="print the created job as JSON")

    sp = cmd("status", cmd_status, "show a job: state, progress, latest metrics, attempts")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("-f", "--follow", action="store_true", help="show progress until it ends")
    sp.add_argument("--interval", type=float, default=0.5, help="--follow: seconds between polls")
    sp.add_argument("--json", action="store_true", help="print the job as JSON")

    sp = cmd("list", cmd_list, "list jobs, newest first")
    sp.add_argument("--state", help="only jobs in this state (queued, running, succeeded, …)")
    sp.add_argument("-n", "--limit", type=int, default=20, help="how many (default 20)")
    sp.add_argument("--json", action="store_true", help="print the jobs as JSON")

    sp = cmd("cancel", cmd_cancel, "cancel a job (idempotent)")
    sp.add_argument("job", help="job id (or a unique prefix)")

    sp = cmd("logs", cmd_logs, "print a job's output (the trainer's stdout and stderr)")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    sp.add_argument("--offset", type=int, default=0, help="start at this byte")

    sp = cmd("metrics", cmd_metrics, "show a job's metrics as a table, CSV or a plot")
    sp.add_argument("job", help="job id (or a unique prefix)")
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

    sp = cmd("download", cmd_download, "download a checkpoint, resumable, sha256-verified")
    sp.add_argument("job", help="job id (or a unique prefix)")
    sp.add_argument(
        "-c", "--checkpoint", default="latest", help="checkpoint id or `latest` (default)"
    )
    sp.add_argument("-o", "--output", help="file or directory to write (default: ./<job>-step<N>)")

    sp = cmd("workers", cmd_workers, "list workers: host, GPU, state, current job, heartbeat")
    sp.add_argument("--json", action="store_true", help="print the workers as JSON")
    return p


# -- commands ----------------------------------------------------------------------------------


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    job = client.submit(spec, idempotency_key=args.idempotency_key)
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
        print(describe_job(job))
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
    print(render.table(["ID", "NAME", "STATE", "ATTEMPT", "PROGRESS", "CREATED"], rows))
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
        print(
            render.plot(
                data,
                width=args.width,
                height=args.height,
                unicode=render.can_unicode(sys.stdout),
                log_y=args.log,
            )
        )
    else:
        names, rows = wide_rows(series)
        print(render.table(["step", *names], rows))
    return EXIT_OK


def cmd_download(client: Client, args: argparse.Namespace) -> int:
    job_id = resolve_job_id(client, args.job)
    live = render.Live(sys.stderr, plain_every_s=2.0)
    rate = _Rate()

    def progress(done: int, total: int | None) -> None:
        live.update(render.transfer_line(done, total, rate(done), live.unicode))

    dl = client.download(job_id, args.checkpoint, args.output, on_progress=progress)
    live.done(render.transfer_line(dl.bytes, dl.bytes, rate(dl.bytes), live.unicode))
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
    print(render.table(["ID", "HOST", "PID", "GPU", "STATE", "JOB", "HEARTBEAT"], rows))
    return EXIT_OK


# -- following a job ----------------------------------------------------------------------------


class _Rate:
    """Bytes or samples per second over a sliding few seconds."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self.points: list[tuple[float, float]] = []

    def __call__(self, value: float) -> float | None:
        now = time.monotonic()
        self.points.append((now, value))
        while len(self.points) > 2 and now - self.points[0][0] > self.window_s:
            self.points.pop(0)
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


def follow_job(
    client: Client, job_id: str, *, interval_s: float = 0.5, stream: TextIO | None = None
) -> int:
    """Draw the job's progress and latest metrics until it ends. Survives the API going away
    for a while (an `up` restart). Exit 0 if it succeeded, 1 if it failed or was cancelled."""
    live = render.Live(stream or sys.stderr)
    latest: dict[str, tuple[int, float]] = {}
    max_step = -1
    said: tuple[Any, ...] = ()
    lost_since: float | None = None
    connected = False
    try:
        while True:
            try:
                job = client.job(job_id)
                new = client.metrics(job_id, after_step=max_step - 1 if max_step >= 0 else None)
                lost_since, connected = None, True
            except ConnectError as e:
                # Retry only a server that answered before (it may be restarting); a wrong
                # URL fails at once.
                lost_since = lost_since or time.monotonic()
                if not connected or time.monotonic() - lost_since > RECONNECT_FOR_S:
                    raise
                live.update(f"API unreachable, retrying… ({str(e).split(';')[0]})")
                time.sleep(2.0)
                continue
            for name, s in new.items():
                for step, value in zip(s.get("steps", []), s.get("values", []), strict=False):
                    if name not in latest or step >= latest[name][0]:
                        latest[name] = (int(step), value)
                    max_step = max(max_step, int(step))
            state = job.get("state")
            if state in TERMINAL_STATES:
                live.done(progress_line(job, latest, live.unicode) if latest else None)
                live.message(summary_line(job, latest))
                return EXIT_OK if state == "succeeded" else EXIT_FAIL
            now_said = (state, job.get("attempt"), job.get("pending_reason"))
            if now_said != said:
                live.message(_state_line(job))
                said = now_said
            if state in ("running", "cancelling"):
                live.update(progress_line(job, latest, live.unicode))
            time.sleep(interval_s)
    except KeyboardInterrupt:
        live.done()
        _err(f"stopped following; the job goes on (torchyard status {job_id})")
        return EXIT_INTERRUPTED


def _state_line(job: dict) -> str:
    state, attempt = job.get("state"), job.get("attempt")
    text = f"{job.get('id', '')[:12]} {state}"
    if attempt and attempt > 1:
        text += f" (attempt {attempt})"
    if state == "queued" and job.get("pending_reason"):
        text += f": {job['pending_reason']}"
    return text


SHOWN_METRICS = ("train/loss", "val/loss", "val/accuracy")


def progress_line(job: dict, latest: dict[str, tuple[int, float]], unicode: bool) -> str:
    p = job.get("progress") or {}
    spec = job.get("spec") or {}
    step, total = p.get("step"), p.get("total_steps")
    frac = step / total if step is not None and total else None
    parts = []
    if p.get("epoch") is not None:
        epochs = spec.get("epochs")
        parts.append(f"epoch {_num(p['epoch'])}" + (f"/{epochs}" if epochs else ""))
    parts.append(render.bar(frac, 24, unicode))
    if step is not None:
        parts.append(f"{step}/{total if total else '?'}")
    if p.get("samples_per_s"):
        parts.append(f"{p['samples_per_s']:,.0f} samples/s")
    if job.get("state") not in TERMINAL_STATES and (frac is None or frac < 1):
        parts.append(f"ETA {render.human_duration(p.get('eta_s'))}")
    for name in SHOWN_METRICS:
        if name in latest:
            parts.append(f"{name} {render.fmt_value(latest[name][1])}")
    return "  ".join(parts)


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


def describe_job(job: dict) -> str:
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
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    attempts = job.get("attempts") or []
    if attempts:
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
        text += "\n\nattempts:\n" + render.table(
            ["#", "STATE", "WORKERS", "STARTED", "ENDED", "EXIT", "REASON"], table_rows
        )
    return text


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


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _err(msg: str) -> None:
    first, *rest = str(msg).splitlines() or [""]
    print(f"error: {first}", file=sys.stderr)
    for line in rest:
        print(f"  {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
