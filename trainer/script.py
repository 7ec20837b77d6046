"""Script jobs: the user's own training script (the spec's `entrypoint`) run from their code
bundle on every rank, in place of torchyard's loop. The script talks to torchyard through
`torchyard.job`; this module is the backend those calls reach during a job.

`run_script(spec, r, code_dir)` is the entry point (trainer/cli.py has already joined the
process group, pinned the device, entered the bundle and installed the stop handlers). It
announces `started`, installs `ScriptBackend` into `torchyard.job`, seeds the RNGs from the
spec, sets `sys.argv` to the script and its arguments and runs it as `__main__`. Then:

- the script returns (or exits 0) after `job.should_stop()` said True: `stopped` (the step
  and file of its last `job.save`), exit PREEMPTED; otherwise `finished`, exit OK;
- it raises (or exits non-zero): its traceback goes to stderr (the job log) and an `error`
  event of kind `user_code` is written, not retried, unless the failure is one of the
  kinds the worker must tell apart (out of memory, a full disk, a lost peer: those keep
  their kind, trainer/failures.py).

What the script's calls write (rank 0): `metric` events and a `progress` event at most once a
second (`job.log`; with the length `job.set_total` declared, and an ETA), and a last one when
the script ends, so that a finished job shows its last step (of the declared length, or of
itself); resume checkpoints `checkpoints/step-XXXXXXXX.pt` through
trainer/checkpoint.py, pruned to `checkpoint.keep_last` and announced as `checkpoint`
events (`job.save`), which is where the worker finds the next attempt's `--resume`; the
final `model.safetensors` (`job.save_weights`); any file the script keeps with the job,
`artifacts/<name>` announced as an `artifact` event (`job.save_artifact`). `job.restore()`
reads `--resume`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import runpy
import shlex
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from torchyard import job
from torchyard.contracts import exitcodes
from torchyard.contracts.spec import JobSpec
from torchyard.trainer.checkpoint import export_weights, prune, save_checkpoint
from torchyard.trainer.distributed import Dist
from torchyard.trainer.envinfo import versions
from torchyard.trainer.failures import UserCodeError, classify, describe
from torchyard.trainer.rungs import Gate, Verdict, load_plan

if TYPE_CHECKING:
    from torchyard.trainer.loop import Run

PROGRESS_EVERY_S = 1.0


def run_script(spec: JobSpec, r: Run, code_dir: Path) -> int:
    """Run the spec's entrypoint script on this rank; an exit code of trainer.exitcodes, never
    an exception (errors end up as one `error` event per failing rank)."""
    assert spec.entrypoint is not None, "run_script needs a spec with `entrypoint`"
    b: ScriptBackend | None = None
    try:
        b = ScriptBackend(spec, r)
        path = script_path(code_dir, spec.entrypoint.script)
        announce_start(spec, r, b)
        with installed(b, [str(path), *spec.entrypoint.args]):
            seed_everything(spec.seed)
            run_user_script(path, r.run_dir)
        return end(r, b)
    except Pruned as p:
        if b is not None:
            b.final_progress(p.step, finished=False)
        return pruned(r, p.step, p.reason)
    except Exception as e:
        kind, code = classify(e, r.run_dir)
        if kind == "internal" or (kind == "user_code" and not isinstance(e, UserCodeError)):
            traceback.print_exc(file=sys.stderr)  # the user's frames are in it
        return fail(r, kind, describe(e), b.last_step if b else 0, code)


class Pruned(BaseException):
    """Raised from `torchyard.job.log` at a rung the pruner pruned: a BaseException, so the
    user's `except Exception` does not swallow it on its way out of their script."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"pruned at step {step}")
        self.step, self.reason = step, reason


class ScriptBackend:
    """What `torchyard.job` does during a script job (the `job.Backend` of the runner). Every
    rank gets every call; rank 0 alone writes."""

    def __init__(self, spec: JobSpec, r: Run) -> None:
        self.spec, self.r, self.d = spec, r, r.dist
        d = self.d
        self.ctx = job.Context(rank=d.rank, world_size=d.world_size, local_rank=d.local_rank,
                               device=d.device, run_dir=r.run_dir, is_main=d.is_main)  # fmt: skip
        self.resume_step = checkpoint_step(r.resume) if r.resume is not None else 0
        self.resumed_from = _relative(r.resume, r.run_dir) if r.resume is not None else None
        self.last_step = self.resume_step  # of the latest log/save call
        # The last resume checkpoint: this attempt's last save, else the one it started from.
        self.saved_step: int | None = self.resume_step if r.resume is not None else None
        self.saved_path: str | None = self.resumed_from
        self.metrics: dict[str, float] = {}  # the last value of each logged metric
        self.saw_stop = False  # should_stop() said True
        self.weights_saved = False
        self.progress_t = -math.inf  # of the last progress event
        self.total: int | None = None  # job.set_total's
        self.start_t, self.start_step = time.monotonic(), self.resume_step  # for the ETA
        # A one-rank script waits at its rungs in log() (each report of the objective is
        # an evaluation); under DDP only rank 0 logs, so its ranks could not wait together.
        plan = load_plan(r.run_dir) if d.world_size == 1 else None
        self.gate = Gate(plan, r.run_dir, d, r.stop, r.events, r.log) if plan else None
        self.reports = plan.offset if plan else 0  # objective reports, earlier attempts' too

    def context(self) -> job.Context:
        return self.ctx

    def params(self) -> dict[str, Any]:
        return copy.deepcopy(self.spec.params or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        if not self.d.is_main:
            return
        self.metrics.update(metrics)
        for name, value in metrics.items():
            self.r.events.emit("metric", step=step, name=name, value=value)
        if time.monotonic() - self.progress_t >= PROGRESS_EVERY_S:
            self.report_progress(step)
        if self.gate is not None and self.gate.plan.metric in metrics:
            self.at_rung(step, metrics[self.gate.plan.metric])

    def set_total(self, total_steps: int) -> None:
        self.total = total_steps
        if self.d.is_main:
            self.report_progress(self.last_step)  # the bar shows at once, at its start

    def report_progress(self, step: int, total: int | None = None) -> None:
        """A `progress` event (rank 0): `total` or the declared length, and the ETA at the
        pace since this attempt started."""
        total = self.total if total is None else total
        now, done = time.monotonic(), step - self.start_step
        eta = None
        if total is not None and done > 0 and step <= total:
            eta = (total - step) * (now - self.start_t) / done
        self.r.events.emit("progress", step=step, total_steps=total, eta_s=eta)
        self.progress_t = now

    def final_progress(self, step: int, finished: bool) -> None:
        """The last `progress` of the attempt (rank 0), where any was shown: a finished run
        with no declared length is as long as its last step."""
        if self.d.is_main and (self.progress_t > -math.inf or self.total is not None):
            self.report_progress(step, self.total or (step if finished else None))

    def at_rung(self, step: int, value: float) -> None:
        """One more report of the objective; at a rung, wait for the verdict (a stop signal
        while waiting leaves should_stop() to say so)."""
        assert self.gate is not None
        self.reports += 1
        if self.gate.plan.is_rung(self.reports):
            value = float(value)
            verdict = self.gate.wait(self.reports, step, value if math.isfinite(value) else None)
            if verdict is Verdict.PRUNE:
                last = self.gate.last
                raise Pruned(step, last.reason if last is not None else "")

    def save(self, state: dict[str, Any], step: int) -> None:
        self.last_step = self.saved_step = step
        self.saved_path = None
        if not self.d.is_main:
            return
        run_dir = self.r.run_dir
        w = save_checkpoint(run_dir, step, {job.STATE_KEY: state})
        pruned = prune(run_dir, self.spec.checkpoint.keep_last, w.path)
        self.r.events.emit("checkpoint", step=step, path=w.path, bytes=w.bytes,
                           sha256=w.sha256, kind="resume", pruned=pruned)  # fmt: skip
        self.saved_path = w.path

    def save_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weights_saved = True
        if not self.d.is_main:
            return
        assert self.spec.entrypoint is not None
        meta = {"script": self.spec.entrypoint.script, "step": str(self.last_step)}
        w = export_weights(self.r.run_dir, job.unshared_cpu(tensors), meta)
        self.r.events.emit("checkpoint", step=self.last_step, path=w.path, bytes=w.bytes,
                           sha256=w.sha256, kind="weights")  # fmt: skip

    def save_artifact(self, source: bytes | Path, name: str) -> None:
        if not self.d.is_main:
            return
        size, sha256 = job.write_artifact(self.r.run_dir, name, source)
        self.r.events.emit("artifact", step=self.last_step, name=name,
                           path=f"{job.ARTIFACT_DIR}/{name}", bytes=size, sha256=sha256)  # fmt: skip

    def restore(self) -> dict[str, Any] | None:
        return job.read_state(self.r.resume) if self.r.resume is not None else None

    def stop_requested(self) -> bool:
        return self.r.stop.signal is not None

    def stopping(self) -> None:
        self.saw_stop = True


# ---------------------------------------------------------------------------- the steps


def checkpoint_step(path: Path) -> int:
    """The step a resume checkpoint was saved at (memory-mapped: the tensors stay on disk)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(ckpt["step"])


def script_path(code_dir: Path, script: str) -> Path:
    """The script inside the bundle (symlinks resolved), or UserCodeError."""
    root = code_dir.resolve()
    path = (root / script).resolve()
    if not path.is_relative_to(root):
        raise UserCodeError(f"entrypoint script {script!r} resolves outside the code bundle")
    if not path.is_file():
        raise UserCodeError(f"entrypoint script {script!r}: no such file in the code bundle")
    return path


def announce_start(spec: JobSpec, r: Run, b: ScriptBackend) -> None:
    """The `started` event and the log's first line (rank 0); loop-only fields are left out."""
    d = r.dist
    if not d.is_main:
        return
    r.events.emit(
        "started",
        world_size=d.world_size,
        device=str(d.device),
        device_name=torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu",
        versions=versions(),
        resumed_from=b.resumed_from,
        step=b.resume_step,
    )
    assert spec.entrypoint is not None
    command = shlex.join([spec.entrypoint.script, *spec.entrypoint.args])
    resumed = f", resuming from {b.resumed_from} (step {b.resume_step})" if b.resumed_from else ""
    r.log(f"running {command}: {d.world_size} rank(s) on {d.device}{resumed}")
    if spec.params:
        r.log("params: " + ", ".join(f"{k}={v!r}" for k, v in spec.params.items()))


@contextmanager
def installed(b: ScriptBackend, argv: list[str]) -> Iterator[None]:
    """`torchyard.job` routed to `b`, `sys.argv` the script's and TORCHYARD_PARAMS the spec's
    params (what `job.params()` reads in a process the script starts), for the script's run."""
    saved, saved_params = sys.argv, os.environ.get(job.PARAMS_ENV)
    sys.argv = argv
    os.environ[job.PARAMS_ENV] = json.dumps(b.spec.params or {})  # for the script's children
    job._install(b)
    try:
        yield
    finally:
        job._install(None)
        sys.argv = saved
        if saved_params is None:
            os.environ.pop(job.PARAMS_ENV, None)
        else:
            os.environ[job.PARAMS_ENV] = saved_params


def seed_everything(seed: int) -> None:
    """The spec's seed in every RNG a script may use (the same on every rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_user_script(path: Path, run_dir: Path) -> None:
    """The script as `__main__`. Its failures come out as UserCodeError (traceback on stderr),
    except those of a kind the worker tells apart (out of memory, a full disk, a lost peer),
    which are re-raised as they are."""
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return
        print(f"trainer: the script exited with status {e.code!r}", file=sys.stderr, flush=True)
        raise UserCodeError(f"SystemExit: {e.code}") from e
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        kind, _ = classify(e, run_dir)
        if kind in ("internal", "user_code"):  # (its traceback is printed above)
            raise UserCodeError(f"{type(e).__name__}: {e}") from e
        raise


def end(r: Run, b: ScriptBackend) -> int:
    """After the script returned: `stopped` when it stopped early on should_stop(), else
    `finished`; then every rank waits for the others (none exits, making torchrun kill the
    rest, before rank 0 has written)."""
    d = r.dist
    stopped = b.saw_stop and not b.weights_saved
    b.final_progress(b.last_step, finished=not stopped)
    if stopped:
        signal = r.stop.signal or "SIGTERM"
        r.events.emit("stopped", signal=signal, step=b.saved_step, checkpoint=b.saved_path)
        if d.is_main:
            r.log(f"stopped by {signal} at step {b.saved_step}; checkpoint {b.saved_path}")
        code = exitcodes.PREEMPTED
    else:
        if d.is_main:
            r.events.emit("finished", step=b.last_step, metrics=dict(b.metrics))
            summary = ", ".join(f"{k} {v:.4g}" for k, v in b.metrics.items())
            r.log(f"finished at step {b.last_step}" + (f": {summary}" if summary else ""))
        code = exitcodes.OK
    _barrier(d)
    return code


def pruned(r: Run, step: int, reason: str) -> int:
    """The pruner stopped this trial at a rung of its script's reports (one rank)."""
    r.events.emit("stopped", signal="pruned", step=step, checkpoint=None)
    r.log(f"pruned at step {step}" + (f": {reason}" if reason else ""))
    return exitcodes.PRUNED


def fail(r: Run, kind: str, message: str, step: int, code: int) -> int:
    print(f"trainer: rank {r.dist.rank}: {kind}: {message}", file=sys.stderr, flush=True)
    try:
        r.events.emit("error", kind=kind, message=message[:4000], step=step, rank=r.dist.rank)
    except OSError as e:  # a full disk: the exit code still says what happened
        print(f"trainer: could not write the error event: {e}", file=sys.stderr, flush=True)
    return code


def _barrier(d: Dist) -> None:
    # The script may have left the process group itself (destroy_process_group).
    if d.ddp and dist.is_initialized():
        dist.barrier()


def _relative(path: Path, run_dir: Path) -> str:
    try:
        return str(path.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(path)
