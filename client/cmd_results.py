"""A job's results: the metrics command (a table, CSV, a terminal plot; TensorBoard files:
client/tbexport.py) and the download
command (a checkpoint, resumable, sha256-verified), with the CSV writer, the step-by-series
rows both the table and the CSV are made of, and what a download prints."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from torchyard.client import render
from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, JOB_HELP, err, show
from torchyard.client.sdk import Client, Download
from torchyard.client.sysview import cmd_system, only_training, training_names
from torchyard.client.tbexport import cmd_tensorboard
from torchyard.contracts.csvcells import text_cell

# A table longer than this is downsampled by the server: rich lays a table out cell by cell
# (about 2 ms a row), and nobody reads ten thousand rows on a terminal (--csv has them all).
TABLE_MAX_ROWS = 1000


def add_result_commands(cmd: Callable[..., Any]) -> None:
    """metrics and download."""
    sp = cmd("metrics", cmd_metrics, "show a job's metrics as a table, CSV or a plot")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument("more", nargs="*", metavar="JOB", help="more jobs (with --tensorboard)")
    sp.add_argument(
        "--name", action="append", help="only this series (repeatable), e.g. --name val/loss"
    )
    out = sp.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="CSV: step, then one column per series")
    out.add_argument("--plot", action="store_true", help="draw the loss curves in the terminal")
    out.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write every point as TensorBoard event files, one run per job under DIR",
    )
    sp.add_argument("--max-points", type=int, help="downsample each series on the server")
    sp.add_argument(
        "--system",
        action="store_true",
        help="the system series (sys/: CPU, memory, GPU; by time): latest, min, max "
        "(with --csv every point); the default view leaves them out",
    )
    sp.add_argument("--log", action="store_true", help="--plot with a logarithmic y axis")
    sp.add_argument("--width", type=int, default=72, help="--plot width in characters")
    sp.add_argument("--height", type=int, default=18, help="--plot height in lines")

    sp = cmd("download", cmd_download, "download a checkpoint, resumable, sha256-verified")
    sp.add_argument("job", help=JOB_HELP)
    sp.add_argument(
        "-c",
        "--checkpoint",
        default="latest",
        help="`latest` (default), `weights`, a step (as `status` and the dashboard show "
        "them) or `step:N` / `id:N`",
    )
    sp.add_argument("-o", "--output", help="file or directory to write (default: ./<job>-step<N>)")


def cmd_metrics(client: Client, args: argparse.Namespace) -> int:
    if args.tensorboard is not None or args.more:
        return cmd_tensorboard(client, args)  # client/tbexport.py
    job_id = client.resolve_job_id(args.job)
    if args.system:
        return cmd_system(client, job_id, args)  # client/sysview.py
    max_points = args.max_points
    if args.plot and max_points is None:
        max_points = max(args.width * 2, 50)
    # Without --name: every series but the system ones (client/sysview.py).
    wanted = args.name or training_names(client, job_id)

    def fetch(points: int | None) -> dict[str, Any]:
        got = client.metrics(job_id, name=wanted, max_points=points) if wanted != [] else {}
        return got if args.name else only_training(got)

    series = fetch(max_points)
    if not series:
        err(f"no metrics yet for job {job_id}")
        return EXIT_FAIL
    if args.csv:
        write_csv(series, sys.stdout)
    elif args.plot:
        names = args.name or [n for n in series if "loss" in n] or list(series)
        data: dict[str, tuple[Sequence[float], Sequence[float]]] = {
            n: (series[n]["steps"], series[n]["values"]) for n in names if n in series
        }
        color = render.colour(render.console(sys.stdout))
        print(render.plot(data, width=args.width, height=args.height, color=color, log_y=args.log))
    else:
        names, rows = wide_rows(series)
        if len(rows) > TABLE_MAX_ROWS and max_points is None:
            series = fetch(TABLE_MAX_ROWS)
            names, rows = wide_rows(series)
            print(
                f"note: {TABLE_MAX_ROWS} rows at most in a table: each row is the last point "
                "of its span of steps; --csv gives every point",
                file=sys.stderr,
            )
        show(render.table(["step", *names], rows))
    return EXIT_OK


def cmd_download(client: Client, args: argparse.Namespace) -> int:
    job_id = client.resolve_job_id(args.job)
    transfer = render.Transfer(sys.stderr)
    spec = client.job(job_id).get("spec") or {}
    dl = client.download(job_id, args.checkpoint, args.output, on_progress=transfer)
    transfer.done(dl.bytes)
    print(describe_download(dl, spec))
    return EXIT_OK


# What a model trained on each built-in data set takes (torchyard.load_model normalises).
_INPUTS = {
    "digits": "uint8 pixels 0..16 as scikit-learn's digits hold them, shape [N, 1, 8, 8]",
    "mnist": "uint8 pixels 0..255, shape [N, 1, 28, 28]",
    "fashion_mnist": "uint8 pixels 0..255, shape [N, 1, 28, 28]",
    "cifar10": "uint8 pixels 0..255, shape [N, 3, 32, 32]",
}


def _input_of(data: dict[str, Any]) -> str:
    name = str(data.get("name") or "")
    if name in _INPUTS:
        return _INPUTS[name]
    if name == "synthetic":
        shape = data.get("shape") or [1, 28, 28]
        return f"uint8 values 0..255, shape [N, {', '.join(map(str, shape))}]"
    if name.startswith("imagefolder/"):
        crop = data.get("image_size") or 224
        return f"uint8 RGB pixels 0..255, resized and center-cropped to [N, 3, {crop}, {crop}]"
    return "what your data set's items hold, batched"


def describe_download(dl: Download, spec: dict[str, Any] | None = None) -> str:
    """Where the file went, and how to load it: what fits the job's kind (the trainer's
    own model, a bundle's model, a script's tensors) and its data set's inputs."""
    spec = spec or {}
    ck = dl.checkpoint
    lines = [
        f"saved {dl.path} ({render.human_bytes(dl.bytes)}, checkpoint {ck.get('id')} "
        f"at step {ck.get('step')})",
        f"sha256 {dl.sha256} verified"
        + (f"; resumed after {render.human_bytes(dl.resumed_from)}" if dl.resumed_from else ""),
        "load it with:",
    ]
    path = json.dumps(str(dl.path))
    model = str((spec.get("model") or {}).get("name") or "")
    if dl.format == "safetensors" and spec.get("entrypoint"):
        lines += [
            "  from safetensors.torch import load_file",
            f"  model.load_state_dict(load_file({path}))  # your script's model, built by you",
        ]
    elif dl.format == "safetensors":
        code = ", code=DIR" if ":" in model else ""
        lines += [
            "  import torchyard",
            f"  model = torchyard.load_model({path}{code})  # eval mode"
            + ("; DIR: the folder you submitted with --code" if code else ""),
            f"  logits = model(x)  # x: {_input_of(spec.get('data') or {})}",
            "  # or the bare tensors: safetensors.torch.load_file(path)",
        ]
    else:
        lines += [
            "  import torch",
            f'  ckpt = torch.load({path}, map_location="cpu", weights_only=True)',
            "  # ckpt['model'] is the model's state_dict (a resume checkpoint: also the "
            "optimizer's)",
        ]
    return "\n".join(lines)


def write_csv(series: dict[str, dict[str, list]], out: TextIO) -> None:
    """A column per series, named as the job named it but never as a spreadsheet formula
    (contracts/csvcells.py); CRLF rows, so a name holding a lone CR is quoted too."""
    names, rows = wide_rows(series)
    w = csv.writer(out, lineterminator="\r\n")
    w.writerow(["step", *map(text_cell, names)])
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
