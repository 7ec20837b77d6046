"""The training loop, top to bottom: data, model, resume, then epochs of steps with
metrics, evaluation and checkpoints, then the final weights.

`run(spec, Run(...))` is the entry point; a `Trainer` is one rank's run of a spec. Its seams
are `build_data` (the data set and this rank's batches), `build_net` (the model on the device)
and `Trainer.train_step` (one optimizer step); the rest is bookkeeping around them.

Rules it keeps:
- Rank 0 alone has side effects (events, checkpoints, stdout); every rank runs the same
  collectives at the same steps, so they can never wait on each other.
- No host sync per step: per-step losses stay on the device and are read (and, under DDP,
  summed over ranks together with the stop flag) once per sync point, every
  `min(log_every_steps, 10)` steps.
- Position = (step, epoch, batch in epoch). The data order of an epoch is a function of
  (seed, epoch) and the lr a function of the step, so a checkpoint's position and RNG
  states are all a resumed run needs to continue exactly.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchyard.contracts import exitcodes
from torchyard.contracts.spec import JobSpec, batch_split_problem, spec_to_dict
from torchyard.trainer.checkpoint import (
    WEIGHTS_FILE,
    WEIGHTS_FORMAT,
    Written,
    capture_rng,
    export_weights,
    load_checkpoint,
    load_init,
    prune,
    restore_rng,
    save_checkpoint,
)
from torchyard.trainer.data import EVAL_BATCH, Batches, DataError, DataSet, load_dataset
from torchyard.trainer.distributed import (
    Dist,
    all_reduce_sum,
    autocast_dtype,
    barrier,
    gather_to_main,
    resolve_precision,
)
from torchyard.trainer.envinfo import versions
from torchyard.trainer.events import EventSink
from torchyard.trainer.failures import UserCodeError, classify, describe
from torchyard.trainer.models import build_model
from torchyard.trainer.optim import build_optimizer, lr_schedule, set_lr
from torchyard.trainer.rungs import Gate, Verdict, load_plan
from torchyard.trainer.signals import StopFlag
from torchyard.trainer.usercode import first_pass

# Losses are read back (one host sync) at most this many steps apart; also the stop-flag check
# interval under DDP, where every rank must agree on the step to stop at.
MAX_SYNC_EVERY = 10
EVAL_METRICS = ("val/loss", "val/accuracy")  # what every rank's evaluation produces
PROGRESS_EVERY_S = 1.0


@dataclass
class Position:
    step: int = 0  # optimizer steps taken (the global step)
    epoch: int = 0  # the epoch in progress, from 0
    batch: int = 0  # batches of that epoch already taken

    @property
    def event_epoch(self) -> int:
        """1-based epoch of the last step taken (0 before the first)."""
        return self.epoch + 1 if self.batch > 0 else self.epoch


@dataclass
class Run:
    """Everything `run` needs besides the spec; tests build one with MemoryEvents."""

    run_dir: Path
    dist: Dist
    events: EventSink
    data_root: Path
    resume: Path | None = None
    stop: StopFlag = field(default_factory=StopFlag)
    log: Callable[[str], None] = print
    init: Path | None = None  # weights that start the model (the spec's `init`)


@dataclass
class Window:
    """Train losses and samples (all ranks) since the last `train/loss` metric."""

    loss: float = 0.0
    n: int = 0
    samples: int = 0
    t: float = field(default_factory=time.perf_counter)
    paused: float = 0.0  # seconds of evaluation in it: not training (train/samples_per_s)


@dataclass
class Pace:
    """Clock marks of this attempt: its start, the last `progress` event, samples trained."""

    start_step: int
    start_t: float = field(default_factory=time.perf_counter)
    last_step: int = 0
    last_t: float = field(default_factory=time.perf_counter)
    samples: int = 0
    paused: float = 0.0  # seconds of evaluation since the start
    paused_at_last: float = 0.0  # `paused` at the last progress event


def run(spec: JobSpec, r: Run) -> int:
    """Train as the spec says; return an exit code of trainer.exitcodes. Errors end up as one
    `error` event (every rank writes its own: trainer/events.py) and a code, never as an
    exception."""
    pos = Position()
    try:
        return Trainer(spec, r, pos).train()
    except DataError as e:
        return _fail(r, "data", str(e), pos, exitcodes.FAILED)
    except Exception as e:
        kind, code = classify(e, r.run_dir)
        if kind == "internal" or (kind == "user_code" and not isinstance(e, UserCodeError)):
            traceback.print_exc(file=sys.stderr)  # the user's frames are in it
        return _fail(r, kind, describe(e), pos, code)


def _fail(r: Run, kind: str, message: str, pos: Position, code: int) -> int:
    print(f"trainer: rank {r.dist.rank}: {kind}: {message}", file=sys.stderr, flush=True)
    try:
        r.events.emit("error", kind=kind, message=message[:4000], step=pos.step, rank=r.dist.rank)
    except OSError as e:  # a full disk: the exit code still says what happened
        print(f"trainer: could not write the error event: {e}", file=sys.stderr, flush=True)
    return code


# ---------------------------------------------------------------------------- the seams


def build_data(spec: JobSpec, d: Dist, data_root: Path) -> tuple[DataSet, Batches]:
    """The spec's data set and this rank's share of each batch, on the device when it fits."""
    assert spec.data is not None
    if problem := batch_split_problem(spec.batch_size, d.world_size):
        raise DataError(f"batch_size {spec.batch_size} {problem}")
    ds = load_dataset(spec.data, data_root, spec.seed)
    batches = Batches(
        ds,
        device=d.device,
        per_rank_batch=spec.batch_size // d.world_size,
        rank=d.rank,
        world=d.world_size,
        seed=spec.seed,
        loader=spec.data.loader,
        num_workers=spec.data.num_workers,
        eval_batch=EVAL_BATCH,
        channels_last=spec.channels_last,
    )
    if batches.steps_per_epoch == 0:
        raise DataError(
            f"the training set has {batches.n_train} samples: too few for {d.world_size} ranks"
        )
    return ds, batches


def build_net(
    spec: JobSpec, ds: DataSet, d: Dist, channels_last: bool, init: Path | None = None
) -> tuple[nn.Module, bool]:
    """The spec's model on the device, with the same initial weights on every rank (the
    seed's, or those of `init`); (model, whether its BatchNorms were made SyncBatchNorm)."""
    assert spec.model is not None
    torch.manual_seed(spec.seed)
    net = build_model(spec.model, ds.sample_shape, ds.num_classes)
    if init is not None:
        load_init(net, init)
    sync_bn = d.ddp and d.device.type == "cuda" and has_batchnorm(net)
    if sync_bn:
        # Statistics over the global batch, as one GPU would compute them. SyncBatchNorm
        # runs on GPUs only: on CPU (gloo) each rank normalises with its own shard's.
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(d.device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    return net, sync_bn


# ---------------------------------------------------------------------------- one rank's run


class Trainer:
    """One rank's run of a spec: built (data, model, optimizer, resume) by the constructor,
    run to an exit code by `train()`. The stages of a run return an exit code when it ends
    there (a non-finite loss, a stop request) and None when it goes on."""

    def __init__(self, spec: JobSpec, r: Run, pos: Position) -> None:
        self.spec, self.r, self.pos = spec, r, pos
        self.d, self.device, self.events = r.dist, r.dist.device, r.events
        self.main = r.dist.is_main
        set_determinism(spec.deterministic, self.device)
        self.precision = resolve_precision(spec.precision, self.d)
        self.ds, self.batches = build_data(spec, self.d, r.data_root)
        spe = self.batches.steps_per_epoch
        self.total_steps = min(spec.epochs * spe, spec.max_steps or sys.maxsize)
        # A resumed attempt starts from its own checkpoint, not from `init`.
        init = r.init if r.resume is None else None
        self.net, self.sync_bn = build_net(spec, self.ds, self.d, self.batches.channels_last, init)
        # A bundle factory's model: its first passes are the user's (`user_pass`).
        model = spec.model
        self.user_model = model.name if model is not None and model.kind == "factory" else None
        self.passed: set[str] = set()  # the passes already guarded in this attempt
        self.opt = build_optimizer(spec, self.net, self.device)
        # One step path for every precision, as in nanoGPT: fp16 needs loss scaling (its
        # gradients underflow), bf16 and fp32 do not, and a disabled scaler passes through.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        amp = autocast_dtype(self.precision)
        self.autocast = torch.autocast(self.device.type, dtype=amp, enabled=amp is not None)
        self.lr_at = lr_schedule(spec, self.total_steps)
        self.metrics: dict[str, float] = {}
        self.resumed_from = self.load_resume(r.resume) if r.resume is not None else None
        self.model, self.fwd = wrap_model(self.net, self.d, spec.compile)
        # The last resume checkpoint (its step and path): the one resumed from counts.
        self.saved_step = pos.step if self.resumed_from else -1
        self.saved_path = self.resumed_from
        self.lr = self.lr_at(pos.step)
        set_lr(self.opt, self.lr)
        self.lr_varies = spec.schedule.name != "constant" or spec.schedule.warmup_steps > 0
        self.sync_every = min(spec.log_every_steps, MAX_SYNC_EVERY)
        self.pending: list[torch.Tensor] = []  # per-step losses since the last sync, on device
        self.evaluated_at = -1
        self.window = Window()
        self.pace = Pace(start_step=pos.step, last_step=pos.step)
        plan = load_plan(r.run_dir)
        self.gate = Gate(plan, r.run_dir, self.d, r.stop, r.events, r.log) if plan else None

    # ---- setup

    def load_resume(self, path: Path) -> str:
        """Continue from a resume checkpoint: weights, optimizer, GradScaler, position, metrics
        and this rank's RNG states. Returns the path as events name it."""
        ckpt = load_checkpoint(path)
        if ckpt["spec"]["model"] != spec_to_dict(self.spec)["model"]:
            raise ValueError(f"{path}: saved for model {ckpt['spec']['model']}, not this spec's")
        self.net.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        if self.scaler.is_enabled() and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.pos.step = int(ckpt["step"])
        self.pos.epoch = int(ckpt["epoch"])
        self.pos.batch = int(ckpt["batch_in_epoch"])
        self.metrics = dict(ckpt.get("metrics") or {})
        rngs = ckpt["rng"]
        restore_rng(rngs[self.d.rank] if len(rngs) == self.d.world_size else rngs[0], self.device)
        return _relative(path, self.r.run_dir)

    # ---- the run

    def train(self) -> int:
        """Announce, train to the last step, then the final evaluation, checkpoint, weights."""
        self.announce_start()
        self.net.train()
        while self.pos.epoch < self.spec.epochs and self.pos.step < self.total_steps:
            if (code := self.train_epoch()) is not None:
                return code
            if self.pos.batch < self.batches.steps_per_epoch:  # max_steps reached mid-epoch
                break
            if (code := self.end_epoch()) is not None:
                return code
        return self.finish()

    def train_epoch(self) -> int | None:
        """The steps of the epoch in progress, from its next batch to its end or the last step."""
        pos, every_steps = self.pos, self.spec.checkpoint.every_steps
        for x, y in self.batches.train_epoch(pos.epoch, pos.batch):
            self.update_lr()
            with self.user_pass("training step"):
                loss = self.train_step(x, y)
            self.pending.append(loss)
            pos.step += 1
            pos.batch += 1
            self.window.samples += len(y) * self.d.world_size
            self.pace.samples += len(y) * self.d.world_size
            if self.sync_due() and (code := self.sync_point()) is not None:
                return code
            if every_steps and pos.step % every_steps == 0:
                self.save_resume()
            if pos.step >= self.total_steps:
                break
        return None

    def update_lr(self) -> None:
        if self.lr_varies and (lr := self.lr_at(self.pos.step)) != self.lr:
            self.lr = lr
            set_lr(self.opt, lr)

    def user_pass(self, what: str) -> AbstractContextManager[None]:
        """The user's model's first `what` of this attempt runs guarded: a failure there
        is theirs, not retried (usercode.first_pass). Built-in models are never guarded."""
        if self.user_model is None or what in self.passed:
            return nullcontext()
        self.passed.add(what)
        return first_pass(self.user_model, what, self.r.run_dir)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch; returns its loss, left on the device (no host sync)."""
        with self.autocast:
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.spec.grad_clip:
            self.scaler.unscale_(self.opt)
            nn.utils.clip_grad_norm_(self.net.parameters(), self.spec.grad_clip)
        self.scaler.step(self.opt)  # no host sync: fused optimizers read the inf flag on the GPU
        self.scaler.update()
        return loss.detach().float()

    def sync_due(self) -> bool:
        """A sync point: a log step, every `sync_every` steps, or (one rank) a stop request."""
        step = self.pos.step
        if step % self.spec.log_every_steps == 0 or step % self.sync_every == 0:
            return True
        return self.r.stop.signal is not None and not self.d.ddp

    def sync_point(self) -> int | None:
        """Mid-epoch: read the losses, log when due, report progress, stop when asked."""
        bad, stopping = self.sync()
        if bad is not None:
            return self.nonfinite(bad)
        if self.pos.step % self.spec.log_every_steps == 0:
            self.log_window()
        self.report_progress()
        return self.stop_now() if stopping else None

    def end_epoch(self) -> int | None:
        """After an epoch's last batch: evaluation and checkpoint when due, then the next."""
        bad, stopping = self.sync()
        if bad is not None:
            return self.nonfinite(bad)
        ep, spec = self.pos.epoch + 1, self.spec
        if spec.eval_every_epochs and ep % spec.eval_every_epochs == 0:
            self.evaluate()
            verdict = self.at_rung(ep // spec.eval_every_epochs)
            if verdict is Verdict.PRUNE:
                return self.pruned()
            stopping = stopping or verdict is Verdict.STOP
        if spec.checkpoint.every_epochs and ep % spec.checkpoint.every_epochs == 0:
            self.save_resume()
        self.report_progress(force=True)
        if stopping:
            return self.stop_now()
        self.pos.epoch, self.pos.batch = ep, 0
        return None

    def finish(self) -> int:
        """The end: last metrics, evaluation, resume checkpoint, then the weights."""
        bad, _ = self.sync()
        if bad is not None:
            return self.nonfinite(bad)
        if self.window.n:
            self.log_window()
        if self.evaluated_at != self.pos.step:
            self.evaluate()
        elapsed = time.perf_counter() - self.pace.start_t - self.pace.paused
        if self.pace.samples:
            self.metrics["train/samples_per_s"] = self.pace.samples / max(elapsed, 1e-9)
        self.save_resume()
        if self.main:
            self.export()
        barrier(self.d)
        return exitcodes.OK

    # ---- the sync point: the one host sync of a window of steps

    def sync(self) -> tuple[int | None, bool]:
        """Read the pending losses (summed over ranks, with the stop flag) in one host sync.
        Returns (first step whose loss is not finite, or None; whether to stop now)."""
        d, world = self.d, self.d.world_size
        if d.ddp:  # the stop flag travels with the losses: every rank stops at the same step
            flag = torch.tensor(1.0 if self.r.stop.signal else 0.0, device=self.device)
            values = all_reduce_sum(d, torch.stack([*self.pending, flag])).tolist()
            losses, stopping = [v / world for v in values[:-1]], values[-1] > 0
        else:
            losses = torch.stack(self.pending).tolist() if self.pending else []
            stopping = self.r.stop.signal is not None
        self.pending.clear()
        first = self.pos.step - len(losses) + 1
        for i, v in enumerate(losses):
            if not math.isfinite(v):
                return first + i, stopping
        self.window.loss += sum(losses)
        self.window.n += len(losses)
        return None, stopping

    def nonfinite(self, at: int) -> int:
        msg = f"loss is not finite at step {at}; lower the learning rate or use fp32/bf16"
        print(f"trainer: nonfinite_loss: {msg}", file=sys.stderr, flush=True)
        self.events.emit("error", kind="nonfinite_loss", message=msg, step=at, rank=self.d.rank)
        barrier(self.d)
        return exitcodes.NONFINITE_LOSS

    def stop_now(self) -> int:
        """A stop request (SIGTERM, a lost lease): checkpoint here, say so, exit PREEMPTED."""
        self.report_progress(force=True)
        path = self.save_resume()
        signal = self.r.stop.signal or "SIGTERM"
        self.events.emit("stopped", signal=signal, step=self.pos.step, checkpoint=path)
        if self.main:
            self.r.log(
                f"stopped by {self.r.stop.signal} at step {self.pos.step}; checkpoint {path}"
            )
        barrier(self.d)  # no rank exits (and makes torchrun kill the others) before the save
        return exitcodes.PREEMPTED

    # ---- a sweep trial's rungs (trainer/rungs.py)

    def at_rung(self, index: int) -> Verdict:
        """After evaluation `index` (from 1): a sweep trial at one of its rungs waits for the
        pruner's verdict. Never at the last evaluation (a trial that finished is complete,
        never pruned), and only on an objective every rank has (a val/ metric)."""
        gate = self.gate
        if gate is None or not gate.plan.is_rung(index) or self.pos.step >= self.total_steps:
            return Verdict.GO
        if gate.plan.metric not in EVAL_METRICS or gate.plan.metric not in self.metrics:
            return Verdict.GO
        t0 = time.perf_counter()
        try:
            return gate.wait(index, self.pos.step, self.metrics[gate.plan.metric])
        finally:  # waiting is not training: the samples/s figures leave it out
            dt = time.perf_counter() - t0
            self.window.paused += dt
            self.pace.paused += dt

    def pruned(self) -> int:
        """The pruner stopped this trial at its rung: say so and exit, without a checkpoint
        (a pruned trial is not resumed)."""
        assert self.gate is not None
        why = self.gate.last.reason if self.gate.last is not None else ""
        self.report_progress(force=True)  # the step it stopped at, not the last report's
        self.events.emit("stopped", signal="pruned", step=self.pos.step, checkpoint=None)
        if self.main:
            self.r.log(f"pruned at step {self.pos.step}" + (f": {why}" if why else ""))
        barrier(self.d)
        return exitcodes.PRUNED

    # ---- reports: metrics, progress, evaluation

    def metric(self, name: str, value: float) -> None:
        self.events.emit(
            "metric", step=self.pos.step, epoch=self.pos.event_epoch, name=name, value=value
        )

    def log_window(self) -> None:
        """train/loss, train/lr and train/samples_per_s over the window, then a new window."""
        now, w, pos = time.perf_counter(), self.window, self.pos
        if w.n and self.main:
            loss, sps = w.loss / w.n, w.samples / max(now - w.t - w.paused, 1e-9)
            self.metrics.update({"train/loss": loss, "train/samples_per_s": sps})
            for name, value in (
                ("train/loss", loss),
                ("train/lr", self.lr),
                ("train/samples_per_s", sps),
            ):
                self.metric(name, value)
            self.r.log(
                f"step {pos.step}/{self.total_steps} epoch {pos.event_epoch} loss {loss:.4f} "
                f"lr {self.lr:.4g} {sps:.0f} samples/s"
            )
        self.window = Window(t=now)

    def report_progress(self, force: bool = False) -> None:
        """A `progress` event at most every PROGRESS_EVERY_S (unless forced), rank 0 only."""
        now, p, step = time.perf_counter(), self.pace, self.pos.step
        if not self.main or (not force and now - p.last_t < PROGRESS_EVERY_S):
            return
        trained_s = now - p.last_t - (p.paused - p.paused_at_last)
        sps = (step - p.last_step) * self.spec.batch_size / max(trained_s, 1e-9)
        done = step - p.start_step
        eta = (self.total_steps - step) * (now - p.start_t) / done if done else None
        self.events.emit(
            "progress",
            step=step,
            total_steps=self.total_steps,
            epoch=self.pos.event_epoch,
            samples_per_s=sps,
            eta_s=eta,
        )
        p.last_t, p.last_step, p.paused_at_last = now, step, p.paused

    def evaluate(self) -> None:
        """val/loss and val/accuracy over every rank's shard; one sync at the end. Its time
        is not training time: the samples/s figures leave it out."""
        self.evaluated_at = self.pos.step
        if self.ds.val is None:
            return
        t0 = time.perf_counter()
        try:
            self._evaluate()
        finally:
            dt = time.perf_counter() - t0
            self.window.paused += dt
            self.pace.paused += dt

    def _evaluate(self) -> None:
        self.net.eval()
        tot = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count
        with torch.no_grad(), self.autocast:
            for x, y in self.batches.val_batches():
                with self.user_pass("evaluation batch"):
                    out = self.fwd(x)
                    tot[0] += F.cross_entropy(out.float(), y, reduction="sum")
                tot[1] += (out.argmax(1) == y).sum()
                tot[2] += len(y)
        self.net.train()
        loss_sum, correct, n = all_reduce_sum(self.d, tot).tolist()
        self.metrics.update({"val/loss": loss_sum / n, "val/accuracy": correct / n})
        for name in ("val/loss", "val/accuracy"):
            self.metric(name, self.metrics[name])
        if self.main:
            self.r.log(
                f"eval step {self.pos.step} val/loss {self.metrics['val/loss']:.4f} "
                f"val/accuracy {self.metrics['val/accuracy']:.4f}"
            )

    def announce_start(self) -> None:
        """The `started` event and the log's first training line (rank 0)."""
        if not self.main:
            return
        spec, d, b, device = self.spec, self.d, self.batches, self.device
        self.events.emit(
            "started",
            world_size=d.world_size,
            device=str(device),
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            precision=self.precision,
            sync_batchnorm=self.sync_bn,
            deterministic=spec.deterministic,
            versions=versions(),
            resumed_from=self.resumed_from,
            step=self.pos.step,
            epoch=self.pos.event_epoch,
            total_steps=self.total_steps,
            steps_per_epoch=b.steps_per_epoch,
            loader=b.mode,
            train_samples=b.n_train,
            val_samples=b.n_val,
            parameters=sum(p.numel() for p in self.net.parameters()),
        )
        self.r.log(
            f"training {spec.display_name}: {self.total_steps - self.pos.step} steps left of "
            f"{self.total_steps}, {b.steps_per_epoch} per epoch, {d.world_size} rank(s) on "
            f"{device}, {self.precision}, data path '{b.mode}'"
        )

    # ---- files: resume checkpoints and the final weights

    def announce_file(self, w: Written, kind: str, **extra: Any) -> None:
        """Tell the worker about a complete, renamed file (never a partial one)."""
        self.events.emit(
            "checkpoint",
            step=self.pos.step,
            epoch=self.pos.event_epoch,
            path=w.path,
            bytes=w.bytes,
            sha256=w.sha256,
            kind=kind,
            **extra,
        )

    def save_resume(self) -> str | None:
        """Resume checkpoint at the current position (collective: gathers every rank's RNG).
        Returns its path on rank 0 (None elsewhere); a step already saved is not saved again."""
        if self.saved_step == self.pos.step:
            return self.saved_path
        rngs = gather_to_main(self.d, capture_rng(self.device))
        path = None
        if self.main:
            w = save_checkpoint(self.r.run_dir, self.pos.step, self.checkpoint_payload(rngs))
            pruned = prune(self.r.run_dir, self.spec.checkpoint.keep_last, w.path)
            self.announce_file(w, "resume", pruned=pruned)
            path = w.path
        self.saved_step, self.saved_path = self.pos.step, path
        return path

    def checkpoint_payload(self, rngs: list[Any]) -> dict[str, Any]:
        """What `load_resume` reads back (trainer/checkpoint.py adds the format and step)."""
        return {
            "model": self.net.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "epoch": self.pos.epoch,
            "batch_in_epoch": self.pos.batch,
            "rng": rngs,
            "world_size": self.d.world_size,
            "spec": spec_to_dict(self.spec),
            "metrics": dict(self.metrics),
        }

    def export(self) -> None:
        """The final weights as safetensors, then `finished` (rank 0)."""
        pos, ds = self.pos, self.ds
        meta = weights_metadata(self.spec, ds, pos.step)
        w = export_weights(self.r.run_dir, self.net.state_dict(), meta)
        assert w.path == WEIGHTS_FILE
        self.announce_file(w, "weights")
        self.events.emit(
            "finished", step=pos.step, epoch=pos.event_epoch, metrics=dict(self.metrics)
        )
        summary = ", ".join(f"{k} {v:.4g}" for k, v in self.metrics.items())
        self.r.log(f"finished at step {pos.step}: {summary}")


# ---------------------------------------------------------------------------- helpers


def weights_metadata(spec: JobSpec, ds: DataSet, step: int) -> dict[str, str]:
    """What `torchyard.load_model` needs to rebuild the model from model.safetensors alone:
    the model and data specs, the input normalisation (in the units the data set's files
    hold) and the class names. safetensors metadata is str -> str: JSON inside."""
    mean, std = ds.input_normalization()
    return {
        "format": WEIGHTS_FORMAT,
        "model": spec.model.name if spec.model else "",
        "num_classes": str(ds.num_classes),
        "input_shape": ",".join(map(str, ds.sample_shape)),
        "step": str(step),
        "model_spec": json.dumps(spec.model.model_dump(mode="json") if spec.model else None),
        "data_spec": json.dumps(spec.data.model_dump(mode="json") if spec.data else None),
        "normalize": json.dumps({"mean": mean, "std": std}),
        "class_names": json.dumps(ds.class_names()),
    }


def set_determinism(deterministic: bool, device: torch.device) -> None:
    """`deterministic: true`: only deterministic kernels, no cuDNN autotuning, no TF32, so
    that a GPU run (and its resume) repeats bit for bit. Otherwise GPUs take the fast path:
    cuDNN picks kernels by timing them and matmuls use TF32, which is why GPU resume is then
    exact only to rounding (CPU runs are exact either way: docs/architecture.md)."""
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; read when its handle is made,
        # i.e. at the first matmul, which is still to come.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)  # both ways: runs in one process
    fast = device.type == "cuda" and not deterministic
    torch.backends.cudnn.benchmark = fast
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cuda.matmul.allow_tf32 = fast
    torch.backends.cudnn.allow_tf32 = fast


def has_batchnorm(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def wrap_model(net: nn.Module, d: Dist, compile: bool) -> tuple[nn.Module, nn.Module]:
    """(module to train, module to evaluate). Under DDP the DDP wrapper is compiled, not
    wrapped around a compiled net: that way dynamo splits the graph at DDP's bucket
    boundaries and gradient all-reduces overlap the backward pass. Evaluation runs the
    plain net (compiled separately: no DDP hooks, no buffer broadcast). Checkpoints always
    save `net.state_dict()`, so keys never carry `module.` or `_orig_mod.` prefixes."""
    train: nn.Module = net
    if d.ddp:
        ids = [d.device.index] if d.device.type == "cuda" else None
        train = DistributedDataParallel(net, device_ids=ids)
    if not compile:
        return train, net
    fwd = torch.compile(net)
    return (torch.compile(train) if d.ddp else fwd), fwd  # type: ignore[return-value]


def _relative(path: Path, run_dir: Path) -> str:
    try:
        return str(path.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(path)
