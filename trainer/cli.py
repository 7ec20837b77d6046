"""`python -m torchyard.trainer --spec SPEC.json --run-dir DIR [--resume CKPT|latest]
[--code-dir DIR] [--init WEIGHTS]` (`--standby` alone: a warm trainer that reads its job from the worker, trainer/standby.py).

Under torchrun every rank runs this same command:

    torchrun --standalone --nproc_per_node=2 -m torchyard.trainer --spec spec.json --run-dir runs/a
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=1 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:PORT -m torchyard.trainer --spec spec.json --run-dir runs/a

The exit status is one of contracts/exitcodes.py. A bad spec, command line or
TORCHYARD_ATTEMPT (the worker's attempt number, stamped on every event: trainer/events.py)
exits 2 with one line per problem on stderr and writes nothing.

`--code-dir` is the job's unpacked code bundle: it goes first on `sys.path` and becomes the
working directory, so the user's modules import as in their own checkout. `--init` is the
file whose weights start the model (the spec's `init`, found by the worker).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from torchyard.contracts import exitcodes
from torchyard.contracts.parent import die_with_parent
from torchyard.contracts.spec import (
    JobSpec,
    SpecError,
    batch_split_problem,
    parse_spec,
    spec_to_dict,
)
from torchyard.trainer.events import attempt_from_env
from torchyard.trainer.lease import LeaseError, watch_lease
from torchyard.trainer.signals import StopFlag

if TYPE_CHECKING:  # torch loads only once the command line and spec are accepted
    from torchyard.trainer.distributed import Dist
    from torchyard.trainer.events import JsonlEvents


ran_user_script = False  # set when this process ran a script job (trainer/__main__.py reads it)


class Refused(Exception):
    """A bad command line, spec or environment: exit BAD_SPEC before anything is written."""


@dataclass(frozen=True)
class Job:
    """What the command line asks for, checked."""

    spec: JobSpec
    attempt: int | None  # TORCHYARD_ATTEMPT, stamped on every event
    run_dir: Path
    resume: Path | None
    code_dir: Path | None = None
    init: Path | None = None


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
    p.add_argument(
        "--code-dir", type=Path, help="the job's code bundle: first on sys.path, the cwd"
    )
    p.add_argument("--init", type=Path, help="weights to start the model from (spec `init`)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    follow_parent()
    stop = StopFlag()
    try:
        job = read_job(args)
        _install_stop_handlers(stop)
        d = _join(stop)
    except Refused as e:
        print(f"trainer: {e}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    enter_code_dir(job.code_dir)
    return _train(job, d, stop)


def follow_parent() -> None:
    """TORCHYARD_DIE_WITH_PARENT=1: get SIGKILLed when the parent (worker/torchrun) dies, and
    exit now if it is already gone, so a trainer never outlives what started it."""
    if os.environ.get("TORCHYARD_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    if not die_with_parent(signal.SIGKILL):
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


def read_job(args: argparse.Namespace) -> Job:
    """The spec, attempt and resume checkpoint the command line names, or Refused saying why."""
    try:
        spec = read_spec(args.spec)
    except SpecError as e:
        lines = "".join(f"\n  {field}: {msg}" for field, msg in e.problems)
        raise Refused(f"invalid spec {args.spec}:{lines}") from None
    try:
        attempt = attempt_from_env()  # refused before anything is written
    except ValueError as e:
        raise Refused(str(e)) from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec.entrypoint is None and (problem := batch_split_problem(spec.batch_size, world)):
        raise Refused(f"batch_size {spec.batch_size} {problem}, the ranks this run has")
    for flag, path, is_dir in (("--code-dir", args.code_dir, True), ("--init", args.init, False)):
        if path is not None and not (path.is_dir() if is_dir else path.is_file()):
            raise Refused(f"{flag} {path}: no such {'directory' if is_dir else 'file'}")
    if spec.entrypoint is not None and args.code_dir is None:
        raise Refused("a spec with `entrypoint` needs --code-dir (the bundle holding the script)")
    return Job(
        spec,
        attempt,
        args.run_dir.absolute(),
        _resume_path(args.resume, args.run_dir.absolute()),
        code_dir=args.code_dir.absolute() if args.code_dir else None,
        init=args.init.absolute() if args.init else None,
    )


def enter_code_dir(code_dir: Path | None) -> None:
    """The bundle first on sys.path and as the working directory (before any user import)."""
    if code_dir is None:
        return
    sys.path.insert(0, str(code_dir))
    os.chdir(code_dir)
    from torchyard.trainer.failures import add_user_root  # (imports torch)

    add_user_root(code_dir)  # an exception raised through its frames is the user's


def _resume_path(arg: str | None, run_dir: Path) -> Path | None:
    if arg == "latest":
        from torchyard.trainer.checkpoint import latest_checkpoint

        return latest_checkpoint(run_dir)
    if not arg:
        return None
    if not Path(arg).is_file():
        raise Refused(f"--resume {arg}: no such file")
    return Path(arg).absolute()  # the cwd may become the code bundle


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


def _join(stop: StopFlag) -> Dist:
    """Watch the lease, then take this rank's device and join the process group. Torch loads
    only now: a bad spec is refused without it."""
    from torchyard.trainer import distributed

    try:
        watch_lease(stop)
        return distributed.setup()
    except (LeaseError, distributed.DeviceError) as e:
        raise Refused(str(e)) from None


def _train(job: Job, d: Dist, stop: StopFlag) -> int:
    """Run the job on this rank; the process group is left (and the events closed) after."""
    from torchyard.trainer.data import data_root_from_env
    from torchyard.trainer.distributed import teardown
    from torchyard.trainer.loop import Run, run

    job.run_dir.mkdir(parents=True, exist_ok=True)
    events = _open_events(job, d)
    try:
        r = Run(
            run_dir=job.run_dir,
            dist=d,
            events=events,
            data_root=data_root_from_env(),
            resume=job.resume,
            stop=stop,
            log=lambda s: print(s, flush=True),
            init=job.init,
        )
        if job.spec.entrypoint is not None:
            from torchyard.trainer.script import run_script

            global ran_user_script
            ran_user_script = True
            assert job.code_dir is not None
            return run_script(job.spec, r, job.code_dir)
        return run(job.spec, r)
    finally:
        events.close()
        teardown(d)


def _open_events(job: Job, d: Dist) -> JsonlEvents:
    """Rank 0: the events file, and the log's head (environment, spec); other ranks: their own
    file of the few events their workers read (trainer/events.py)."""
    from torchyard.trainer.events import EVENTS_FILE, JsonlEvents, RankEvents, rank_events_file

    if not d.is_main:
        return RankEvents(job.run_dir / rank_events_file(d.rank), attempt=job.attempt)
    events = JsonlEvents(job.run_dir / EVENTS_FILE, attempt=job.attempt)
    _log_head(job, d)
    return events


def _log_head(job: Job, d: Dist) -> None:
    from torchyard.trainer.data import data_root_from_env
    from torchyard.trainer.envinfo import environment

    env = environment(d.device, d.rank, d.world_size)
    env.update(
        attempt=job.attempt,
        run_dir=str(job.run_dir),
        resume=str(job.resume) if job.resume else None,
        data_root=str(data_root_from_env()),
    )
    print("environment: " + json.dumps(env, sort_keys=True), flush=True)
    print("spec: " + json.dumps(spec_to_dict(job.spec), sort_keys=True), flush=True)
    if job.spec.world_size != d.world_size:
        print(
            f"warning: the spec asks for world_size {job.spec.world_size}, running on "
            f"{d.world_size}",
            flush=True,
        )
