"""`python -m torchyard.trainer --standby`: a trainer started before its job (the worker's
warm trainer, worker/standby.py), so a job's first step does not wait for `import torch`.

It follows its parent as the trainer does, imports torch and the training modules (no CUDA,
no process group, no data), then reads ONE JSON line on stdin from the worker (a pipe, never
a user): the job's arguments, its whole environment, and its log file (or none, when its
output already goes through the worker's pipe). It appends its stdout and stderr to that
log, moves into the run directory, takes the environment, and
runs exactly `trainer.cli.main` with those arguments: same events, same exit codes.

Once its imports are done it writes `READY_LINE` on its output (still the worker's pipe):
the worker's sign that its slot is warm (worker/standby.py `ReadyPump`), which placement
prefers (scheduler/policy.py). End of input (the worker stopping) exits 0 quietly; SIGTERM
while waiting ends it too (the default action). A message that is not what the worker
sends exits BAD_SPEC with one line on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from torchyard.contracts import exitcodes
from torchyard.trainer.cli import follow_parent
from torchyard.trainer.cli import main as trainer_main

OPTIONS = frozenset({"--resume", "--code-dir", "--init"})
# Kept equal to worker/standby.py READY_LINE (the worker never imports the trainer).
READY_LINE = b"[torchyard] warm trainer ready\n"


class Go(BaseModel):
    """The worker's go message: what today's argv, environment and log fd carry."""

    model_config = ConfigDict(extra="forbid", strict=True)

    spec: str
    run_dir: str
    options: list[str] = []  # --resume, --code-dir, --init with their absolute paths
    env: dict[str, str]
    log: str = ""  # "": the output already goes where it should (the worker's pipe)

    @field_validator("spec", "run_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not os.path.isabs(v):
            raise ValueError("must be an absolute path")
        return v

    @field_validator("log")
    @classmethod
    def _log(cls, v: str) -> str:
        if v and not os.path.isabs(v):
            raise ValueError("must be an absolute path or empty")
        return v

    @field_validator("options")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        flags, paths = v[0::2], v[1::2]
        if len(flags) != len(paths) or not set(flags) <= OPTIONS:
            raise ValueError(f"must be pairs of {', '.join(sorted(OPTIONS))} and a path")
        if not all(os.path.isabs(p) for p in paths):
            raise ValueError("paths must be absolute")
        return v

    def argv(self) -> list[str]:
        return ["--spec", self.spec, "--run-dir", self.run_dir, *self.options]


def warm_up() -> None:
    """Import what the first step would otherwise wait for; initialise nothing."""
    import torch
    import torch._inductor.config  # noqa: F401  (torch.use_deterministic_algorithms: +2 s, dynamo)

    import torchyard.trainer.envinfo
    import torchyard.trainer.events
    import torchyard.trainer.loop  # noqa: F401  (data, models, optim, checkpoint, distributed)


def say_ready() -> None:
    """Tell the worker the imports are done, in one write (atomic on a pipe); an output it
    cannot take (a closed pipe) only costs the slot its warm mark."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stdout.fileno(), READY_LINE)


def read_go(line: bytes) -> Go:
    """The go message, or ValueError saying what is wrong with it."""
    try:
        return Go.model_validate_json(line)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'message'}: {err['msg']}"
            for err in e.errors()
        )
        raise ValueError(problems) from None


def _become(go: Go) -> None:
    """Take the job's log as stdout and stderr (appended, as the worker opens it for a cold
    trainer), its run directory as cwd, and its environment."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)  # the worker's pipe is done with, as cold: DEVNULL
    os.dup2(null, 0)
    os.close(null)
    if go.log:
        fd = os.open(go.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)
    os.chdir(go.run_dir)
    os.environ.clear()
    os.environ.update(go.env)


def main() -> int:
    follow_parent()
    warm_up()
    say_ready()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0  # the worker is stopping (or gave up on us): nothing to do
    try:
        go = read_go(line)
    except ValueError as e:
        print(f"trainer --standby: bad go message: {e}", file=sys.stderr)
        return exitcodes.BAD_SPEC
    _become(go)
    return trainer_main(go.argv())


if __name__ == "__main__":  # pragma: no cover - run via `python -m torchyard.trainer`
    sys.exit(main())
