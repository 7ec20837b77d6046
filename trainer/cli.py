"""`python -m torchyard.trainer --spec SPEC.json --run-dir DIR [--resume CKPT|latest]`.

Under torchrun every rank runs this same command:

    torchrun --standalone --nproc_per_node=2 -m torchyard.trainer --spec spec.json --run-dir runs/a
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=1 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:PORT -m torchyard.trainer --spec spec.json --run-dir runs/a

The exit status is one of trainer/exitcodes.py. A bad spec, command line or
TORCHYARD_ATTEMPT (the worker's attempt number, stamped on every event: trainer/events.py)
exits 2 with one line per problem on stderr and writes nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from torchyard.trainer import exitcodes
from torchyard.trainer.events import attempt_from_env
from torchyard.trainer.lease import LeaseError, watch_lease
from torchyard.trainer.signals import StopFlag
from torchyard.trainer.spec import JobSpec, SpecError, parse_spec, spec_to_dict

PR_SET_PDEATHSIG = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"trainer: {message}", file=sys.stderr)
        raise SystemExit(exitcodes.BAD_SPEC)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m torchyard.trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, type=Path, help="job spec JSON (trainer.spec.JobSpec)")
    p.add_argument(
        "--run-dir", required=True, type=Path, help="events, checkpoints and weights go here"
    )
    p.add_argument(
        "--resume",
        help="resume checkpoint to continue from; `latest` picks the newest in the run dir (if any)",
    )
    return p


def die_with_parent() -> None:
    """TORCHYARD_DIE_WITH_PARENT=1: get SIGKILLed when the parent (worker/torchrun) dies, and
    exit now if it is already gone, so a trainer never outlives what started it."""
    if os.environ.get("TORCHYARD_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print("trainer: prctl(PR_SET_PDEATHSIG) failed", file=sys.stderr)
    if os.getppid() == 1:
        print("trainer: parent process is gone; exiting", file=sys.stderr)
        raise SystemExit(exitcodes.FAILED)


def read_spec(path: Path) -> JobSpec:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError([("spec", f"file not found: {path}")]) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError([("spec", f"not a JSON file: {e}")]) from None
    return parse_spec(obj)


def _install_stop_handlers(stop: StopFlag) -> None:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop at the next step boundary. A repeated
    SIGTERM changes nothing (it often comes twice: from the worker to the process group and
    from torchrun forwarding it); a second Ctrl-C (SIGINT) stops at once."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        if stop.signal is None:
            stop.signal = signal.Signals(signum).name
        elif signum == signal.SIGINT and stop.signal == "SIGINT":
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    die_with_parent()
    try:
        spec = read_spec(args.spec)
    except SpecError as e:
        print(f"trainer: invalid spec {args.spec}:", file=sys.stderr)
        for field, msg in e.problems:
            print(f"  {field}: {msg}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    try:
        attempt = attempt_from_env()  # refused before anything is written
    except ValueError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec.batch_size % world:
        print(
            f"trainer: batch_size {spec.batch_size} is not divisible by the world size {world}",
            file=sys.stderr,
        )
        return exitcodes.BAD_SPEC
    run_dir: Path = args.run_dir
    resume: Path | None = None
    if args.resume == "latest":
        from torchyard.trainer.checkpoint import latest_checkpoint

        resume = latest_checkpoint(run_dir)
    elif args.resume:
        resume = Path(args.resume)
        if not resume.is_file():
            print(f"trainer: --resume {resume}: no such file", file=sys.stderr)
            return exitcodes.BAD_SPEC

    # Torch loads only now: a bad spec is refused without it.
    from torchyard.trainer import distributed
    from torchyard.trainer.data import data_root_from_env
    from torchyard.trainer.envinfo import environment
    from torchyard.trainer.events import EVENTS_FILE, JsonlEvents, RankEvents, rank_events_file
    from torchyard.trainer.loop import Run, run

    stop = StopFlag()
    _install_stop_handlers(stop)
    try:
        watch_lease(stop)
    except LeaseError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    try:
        d = distributed.setup()
    except distributed.DeviceError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    run_dir.mkdir(parents=True, exist_ok=True)
    events: JsonlEvents
    if d.is_main:
        events = JsonlEvents(run_dir / EVENTS_FILE, attempt=attempt)
        env = environment(d.device, d.rank, d.world_size)
        env.update(
            attempt=attempt,
            run_dir=str(run_dir),
            resume=str(resume) if resume else None,
            data_root=str(data_root_from_env()),
        )
        print("environment: " + json.dumps(env, sort_keys=True), flush=True)
        print("spec: " + json.dumps(spec_to_dict(spec), sort_keys=True), flush=True)
        if spec.world_size != d.world_size:
            print(
                f"warning: the spec asks for world_size {spec.world_size}, running on "
                f"{d.world_size}",
                flush=True,
            )
    else:
        events = RankEvents(run_dir / rank_events_file(d.rank), attempt=attempt)
    try:
        r = Run(
            run_dir=run_dir,
            dist=d,
            events=events,
            data_root=data_root_from_env(),
            resume=resume,
            stop=stop,
            log=lambda s: print(s, flush=True),
        )
        return run(spec, r)
    finally:
        events.close()
        distributed.teardown(d)
