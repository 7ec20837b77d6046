"""`torchyard metrics JOB [JOB ...] --tensorboard DIR`: each job's every metric point as
TensorBoard scalars (tag = metric name, step, wall time = the point's time), one run
directory per job (`<job name>-<id prefix>`, so TensorBoard shows runs side by side).
Points come page by page from the metrics API (`Client.metric_pages`) and go straight to
the event file (client/tbevents.py). A run is written beside its final place and renamed
over it: exporting a job again replaces its run, never adds its points twice."""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, err, note
from torchyard.client.sdk import Client
from torchyard.client.tbevents import EventWriter
from torchyard.contracts.plurals import plural

EVENT_PREFIX = "events.out.tfevents."


class ExportRefused(Exception):
    """The run directory holds something else than an earlier export's event files."""


@dataclass(frozen=True)
class ExportedRun:
    job_id: str
    path: Path
    series: int
    points: int


def run_name(job: dict) -> str:
    """`<job name>-<first 8 of the id>`, in letters, digits, `.`, `_` and `-` only."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(job.get("name") or "")).strip("._-")
    return f"{name[:64] or 'job'}-{str(job['id'])[:8]}"


def export_job(
    client: Client, job_id: str, directory: Path, *, name: list[str] | None = None
) -> ExportedRun:
    """One job's run directory under `directory` (every series, or those in `name`),
    replacing an earlier export of it."""
    job = client.job(job_id)
    target = directory / run_name(job)
    _check_replaceable(target)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=directory))
    try:
        series, points = _write_run(client, str(job["id"]), staging, name)
        if target.exists():
            shutil.rmtree(target)
        staging.chmod(0o755)  # mkdtemp made it private; a TensorBoard of others may read it
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportedRun(str(job["id"]), target, len(series), points)


def _write_run(
    client: Client, job_id: str, staging: Path, name: list[str] | None
) -> tuple[set[str], int]:
    writer = EventWriter(staging)
    names: set[str] = set()
    points = 0
    try:
        for page in client.metric_pages(job_id, name=name):
            rows = [
                (tag, step, value, when)
                for tag, s in page.items()
                for step, value, when in zip(s["steps"], s["values"], s["times"], strict=True)
                if value is not None
            ]
            rows.sort(key=lambda r: (r[1], r[0]))  # by step: the order they were logged in
            writer.scalars(rows)
            names.update(tag for tag, s in page.items() if s["steps"])
            points += len(rows)
    finally:
        writer.close()
    return names, points


def _check_replaceable(target: Path) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ExportRefused(f"{target} is not a directory: remove it or choose another DIR")
    if target.is_dir():
        others = [p.name for p in target.iterdir() if not (p.is_file() and p.name.startswith(EVENT_PREFIX))]  # fmt: skip
        if others:
            raise ExportRefused(
                f"{target} holds more than an earlier export's event files ({others[0]}, …): "
                "remove it or choose another DIR"
            )


def cmd_tensorboard(client: Client, args: argparse.Namespace) -> int:
    """`metrics JOB [JOB ...] --tensorboard DIR`: one run per job, then how to look."""
    if args.tensorboard is None:
        err("several jobs at once only with --tensorboard DIR")
        return EXIT_USAGE
    directory = Path(args.tensorboard).expanduser()
    job_ids = list(dict.fromkeys(client.resolve_job_id(j) for j in [args.job, *args.more]))
    for job_id in job_ids:
        try:
            run = export_job(client, job_id, directory, name=args.name)
        except (ExportRefused, OSError) as e:
            err(str(e))
            return EXIT_FAIL
        counts = f"{plural(run.points, 'point')} of {plural(run.series, 'series', 'series')}"
        print(f"{run.path}: {counts} (job {run.job_id})")
    note(f"look at them with: tensorboard --logdir {directory}")
    return EXIT_OK
