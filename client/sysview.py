"""`torchyard metrics JOB --system`: a job's system series (`sys/…`, sampled by its workers,
indexed by Unix second) as one row each (latest value, min, max, points, the time span), or
with `--csv` every point by time; and which series the default, training view asks for
(every name but `sys/…`, so a job's loss table is not buried under its memory samples)."""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from torchyard.client import render
from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, err, show
from torchyard.client.sdk import Client
from torchyard.contracts.eventmodel import SYS_PREFIX

SUMMARY_POINTS = 1000  # buckets asked for: each keeps its min and max, so the extremes are exact
NAMES_PER_REQUEST_CHARS = 1500  # comma-joined names in one request's query


def is_system(name: str) -> bool:
    return name.startswith(SYS_PREFIX)


def name_batches(names: list[str]) -> list[str]:
    """`names` comma-joined into as few `name=` values as keep each request short."""
    out: list[str] = []
    for n in names:
        if out and len(out[-1]) + 1 + len(n) <= NAMES_PER_REQUEST_CHARS:
            out[-1] += "," + n
        else:
            out.append(n)
    return out


def training_names(client: Client, job_id: str) -> list[str] | None:
    """The `name=` values of the default view: the job's series but `sys/…` ([] when it has
    only those); None to ask for every series (a name holding a comma cannot be asked for
    by name)."""
    names = list((client.job(job_id).get("latest_metrics") or {}).keys())
    if any("," in n for n in names):
        return None
    return name_batches(sorted(n for n in names if not is_system(n)))


def only_training(series: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in series.items() if not is_system(n)}


def _unit(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    if name.endswith("_bytes"):
        return render.human_bytes(v)
    if name.endswith("_percent"):
        return f"{v:.1f}%"
    if name.endswith("_watts"):
        return f"{v:.1f} W"
    if name.endswith("_c"):
        return f"{v:.0f} °C"
    return render.fmt_value(v)


def _when(step: int) -> str:
    return datetime.fromtimestamp(step, UTC).strftime("%Y-%m-%d %H:%M:%S")


def summary_rows(series: dict[str, dict[str, list]]) -> list[list[str]]:
    """One row per system series: name, latest, min, max, first and last time (UTC).
    `series` may be downsampled: each bucket's `min`/`max` keep the extremes exact."""
    rows = []
    for name in sorted(series):
        s = series[name]
        steps, values = s.get("steps") or [], s.get("values") or []
        lows = [v for v in s.get("min", values) if v is not None]
        highs = [v for v in s.get("max", values) if v is not None]
        if not steps:
            continue
        latest = values[-1] if values else None
        rows.append([name, _unit(name, latest), _unit(name, min(lows, default=None)),
                     _unit(name, max(highs, default=None)), _when(int(steps[0])),
                     _when(int(steps[-1]))])  # fmt: skip
    return rows


def write_time_csv(series: dict[str, dict[str, list]], out: TextIO) -> None:
    """`time` (Unix seconds: the series' step), then one column per system series."""
    names = sorted(series)
    by_time: dict[int, dict[str, Any]] = {}
    for n in names:
        for t, v in zip(series[n].get("steps", []), series[n].get("values", []), strict=False):
            by_time.setdefault(int(t), {})[n] = v
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["time", *names])
    for t in sorted(by_time):
        w.writerow([t, *("" if by_time[t].get(n) is None else repr(by_time[t][n]) for n in names)])


def cmd_system(client: Client, job_id: str, args: argparse.Namespace) -> int:
    """`metrics JOB --system`: the system series, summarised (or every point, `--csv`)."""
    if args.plot:
        err("--system shows a table or --csv; plot one series with --plot --name sys/cpu_percent")
        return EXIT_USAGE
    names = [n for n in (client.job(job_id).get("latest_metrics") or {}) if is_system(n)]
    if args.name:
        names = [n for n in names if n in args.name]
    if not names:
        err(f"no system metrics for job {job_id} (TORCHYARD_SYS_METRICS_INTERVAL_S on its workers)")
        return EXIT_FAIL
    batches = name_batches(sorted(names))
    if args.csv:
        write_time_csv(client.metrics(job_id, name=batches, max_points=args.max_points), sys.stdout)
        return EXIT_OK
    series = client.metrics(job_id, name=batches, max_points=args.max_points or SUMMARY_POINTS)
    headers = ["series", "latest", "min", "max", "from (UTC)", "to (UTC)"]
    show(render.table(headers, summary_rows(series)))
    return EXIT_OK
