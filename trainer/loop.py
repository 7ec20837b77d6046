"""The training loop, top to bottom: data, model, resume, then epochs of steps with
metrics, evaluation and checkpoints, then the final weights.

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

import contextlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchyard.trainer import exitcodes
from torchyard.trainer.checkpoint import (
    WEIGHTS_FILE,
    Written,
    capture_rng,
    export_weights,
    load_checkpoint,
    prune,
    restore_rng,
    save_checkpoint,
)
from torchyard.trainer.data import Batches, DataError, load_dataset
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
from torchyard.trainer.failures import classify
from torchyard.trainer.models import build_model
from torchyard.trainer.optim import build_optimizer, lr_schedule, set_lr
from torchyard.trainer.signals import StopFlag
from torchyard.trainer.spec import JobSpec, spec_to_dict

# Losses are read back (one host sync) at most this many steps apart; also the stop-flag check
# interval under DDP, where every rank must agree on the step to stop at.
MAX_SYNC_EVERY = 10
PROGRESS_EVERY_S = 1.0
EVAL_BATCH = 1024


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


def run(spec: JobSpec, r: Run) -> int:
    """Train as the spec says; return an exit code of trainer.exitcodes. Errors end up as one
    `error` event (every rank writes its own: trainer/events.py) and a code, never as an
    exception."""
    pos = Position()
    try:
        return _train(spec, r, pos)
    except DataError as e:
        return _fail(r, "data", str(e), pos, exitcodes.FAILED)
    except Exception as e:
        kind, code = classify(e, r.run_dir)
        if kind == "internal":
            traceback.print_exc(file=sys.stderr)
        return _fail(r, kind, f"{type(e).__name__}: {e}", pos, code)


def _fail(r: Run, kind: str, message: str, pos: Position, code: int) -> int:
    print(f"trainer: rank {r.dist.rank}: {kind}: {message}", file=sys.stderr, flush=True)
    try:
        r.events.emit("error", kind=kind, message=message[:4000], step=pos.step, rank=r.dist.rank)
    except OSError as e:  # a full disk: the exit code still says what happened
        print(f"trainer: could not write the error event: {e}", file=sys.stderr, flush=True)
    return code


def _train(spec: JobSpec, r: Run, pos: Position) -> int:
    d, events, main = r.dist, r.events, r.dist.is_main
    device, W = d.device, d.world_size
    if spec.batch_size % W:
        raise DataError(f"batch_size {spec.batch_size} is not divisible by world size {W}")
    set_determinism(spec.deterministic, device)
    precision = resolve_precision(spec.precision, d)
    amp = autocast_dtype(precision)

    # ---- data: once, onto the device when it fits
    ds = load_dataset(spec.data, r.data_root, spec.seed)
    per_rank = spec.batch_size // W
    batches = Batches(
        ds,
        device,
        per_rank,
        d.rank,
        W,
        spec.seed,
        spec.data.loader,
        spec.data.num_workers,
        EVAL_BATCH,
        spec.channels_last,
    )
    spe = batches.steps_per_epoch
    if spe == 0:
        raise DataError(f"the training set has {batches.n_train} samples: too few for {W} ranks")
    total_steps = min(spec.epochs * spe, spec.max_steps or sys.maxsize)

    # ---- model, optimizer, precision: the same initial weights on every rank
    torch.manual_seed(spec.seed)
    net = build_model(spec.model, ds.sample_shape, ds.num_classes)
    sync_bn = d.ddp and device.type == "cuda" and has_batchnorm(net)
    if sync_bn:
        # Statistics over the global batch, as one GPU would compute them. SyncBatchNorm
        # runs on GPUs only: on CPU (gloo) each rank normalises with its own shard's.
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(device)
    if batches.channels_last:
        net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    opt = build_optimizer(spec, net, device)
    # One step path for every precision: a disabled scaler passes everything through.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    lr_at = lr_schedule(spec, total_steps)
    metrics: dict[str, float] = {}

    # ---- resume: weights, optimizer, scaler, position, RNG
    resumed_from = None
    if r.resume is not None:
        ckpt = load_checkpoint(r.resume)
        if ckpt["spec"]["model"] != spec_to_dict(spec)["model"]:
            raise ValueError(
                f"{r.resume}: saved for model {ckpt['spec']['model']}, not this spec's"
            )
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        if scaler.is_enabled() and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        pos = _resume_position(pos, ckpt)
        metrics = dict(ckpt.get("metrics") or {})
        rngs = ckpt["rng"]
        restore_rng(rngs[d.rank] if len(rngs) == W else rngs[0], device)
        resumed_from = _relative(r.resume, r.run_dir)

    model, fwd = wrap_model(net, d, spec.compile)
    autocast = (
        torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    )

    last_saved: dict[str, Any] = {"step": pos.step if resumed_from else -1, "path": resumed_from}

    def announce(w: Written, kind: str, **extra: Any) -> None:
        """Tell the worker about a complete, renamed file (never a partial one)."""
        events.emit(
            "checkpoint",
            step=pos.step,
            epoch=pos.event_epoch,
            path=w.path,
            bytes=w.bytes,
            sha256=w.sha256,
            kind=kind,
            **extra,
        )

    def save_resume() -> str | None:
        """Resume checkpoint at the current position (collective: gathers every rank's RNG)."""
        if last_saved["step"] == pos.step:
            return last_saved["path"]
        rngs = gather_to_main(d, capture_rng(device))
        path = None
        if main:
            payload = {
                "model": net.state_dict(),
                "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "epoch": pos.epoch,
                "batch_in_epoch": pos.batch,
                "rng": rngs,
                "world_size": W,
                "spec": spec_to_dict(spec),
                "metrics": dict(metrics),
            }
            w = save_checkpoint(r.run_dir, pos.step, payload)
            pruned = prune(r.run_dir, spec.checkpoint.keep_last, w.path)
            announce(w, "resume", pruned=pruned)
            path = w.path
        last_saved.update(step=pos.step, path=path)
        return path

    def evaluate() -> None:
        """val/loss and val/accuracy over every rank's shard; one sync at the end."""
        if ds.val is None:
            return
        net.eval()
        tot = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        with torch.no_grad(), autocast:
            for x, y in batches.val_batches():
                out = fwd(x)
                tot[0] += F.cross_entropy(out.float(), y, reduction="sum")
                tot[1] += (out.argmax(1) == y).sum()
                tot[2] += len(y)
        net.train()
        loss_sum, correct, n = all_reduce_sum(d, tot).tolist()
        metrics.update({"val/loss": loss_sum / n, "val/accuracy": correct / n})
        for name in ("val/loss", "val/accuracy"):
            events.emit(
                "metric", step=pos.step, epoch=pos.event_epoch, name=name, value=metrics[name]
            )
        if main:
            r.log(
                f"eval step {pos.step} val/loss {metrics['val/loss']:.4f} "
                f"val/accuracy {metrics['val/accuracy']:.4f}"
            )

    # ---- announce, then train
    if main:
        events.emit(
            "started",
            world_size=W,
            device=str(device),
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            precision=precision,
            sync_batchnorm=sync_bn,
            deterministic=spec.deterministic,
            versions=versions(),
            resumed_from=resumed_from,
            step=pos.step,
            epoch=pos.event_epoch,
            total_steps=total_steps,
            steps_per_epoch=spe,
            loader=batches.mode,
            train_samples=batches.n_train,
            val_samples=batches.n_val,
            parameters=sum(p.numel() for p in net.parameters()),
        )
        r.log(
            f"training {spec.display_name}: {total_steps - pos.step} steps left of {total_steps}, "
            f"{spe} per epoch, {W} rank(s) on {device}, {precision}, data path '{batches.mode}'"
        )

    sync_every = min(spec.log_every_steps, MAX_SYNC_EVERY)
    every_steps = spec.checkpoint.every_steps
    pending: list[torch.Tensor] = []  # per-step losses since the last sync, on the device
    window = {"loss": 0.0, "n": 0, "samples": 0, "t": time.perf_counter()}
    progress = {"t": time.perf_counter(), "step": pos.step}
    attempt_start = (time.perf_counter(), pos.step)
    samples_seen = 0
    lr = lr_at(pos.step)
    set_lr(opt, lr)
    lr_varies = spec.schedule.name != "constant" or spec.schedule.warmup_steps > 0
    evaluated_at = -1

    def sync() -> tuple[int | None, bool]:
        """Read the pending losses (summed over ranks, with the stop flag) in one host sync.
        Returns (first step whose loss is not finite, or None; whether to stop now)."""
        if d.ddp:  # the stop flag travels with the losses: every rank stops at the same step
            flag = torch.tensor(1.0 if r.stop.signal else 0.0, device=device)
            values = all_reduce_sum(d, torch.stack([*pending, flag])).tolist()
            losses, stopping = [v / W for v in values[:-1]], values[-1] > 0
        else:
            losses = torch.stack(pending).tolist() if pending else []
            stopping = r.stop.signal is not None
        pending.clear()
        first = pos.step - len(losses) + 1
        for i, v in enumerate(losses):
            if not math.isfinite(v):
                return first + i, stopping
        window["loss"] += sum(losses)
        window["n"] += len(losses)
        return None, stopping

    def log_window() -> None:
        now = time.perf_counter()
        if window["n"] and main:
            loss = window["loss"] / window["n"]
            sps = window["samples"] / max(now - window["t"], 1e-9)
            metrics.update({"train/loss": loss, "train/samples_per_s": sps})
            for name, value in (
                ("train/loss", loss),
                ("train/lr", lr),
                ("train/samples_per_s", sps),
            ):
                events.emit("metric", step=pos.step, epoch=pos.event_epoch, name=name, value=value)
            r.log(
                f"step {pos.step}/{total_steps} epoch {pos.event_epoch} loss {loss:.4f} "
                f"lr {lr:.4g} {sps:.0f} samples/s"
            )
        window.update(loss=0.0, n=0, samples=0, t=now)

    def report_progress(force: bool = False) -> None:
        now = time.perf_counter()
        if not main or (not force and now - progress["t"] < PROGRESS_EVERY_S):
            return
        sps = (pos.step - progress["step"]) * spec.batch_size / max(now - progress["t"], 1e-9)
        done = pos.step - attempt_start[1]
        eta = (total_steps - pos.step) * (now - attempt_start[0]) / done if done else None
        events.emit(
            "progress",
            step=pos.step,
            total_steps=total_steps,
            epoch=pos.event_epoch,
            samples_per_s=sps,
            eta_s=eta,
        )
        progress.update(t=now, step=pos.step)

    def nonfinite(at: int) -> int:
        msg = f"loss is not finite at step {at}; lower the learning rate or use fp32/bf16"
        print(f"trainer: nonfinite_loss: {msg}", file=sys.stderr, flush=True)
        events.emit("error", kind="nonfinite_loss", message=msg, step=at, rank=d.rank)
        barrier(d)
        return exitcodes.NONFINITE_LOSS

    def stop_now() -> int:
        path = save_resume()
        events.emit("stopped", signal=r.stop.signal or "SIGTERM", step=pos.step, checkpoint=path)
        if main:
            r.log(f"stopped by {r.stop.signal} at step {pos.step}; checkpoint {path}")
        barrier(d)  # no rank exits (and makes torchrun kill the others) before the save is done
        return exitcodes.PREEMPTED

    net.train()
    while pos.epoch < spec.epochs and pos.step < total_steps:
        for x, y in batches.train_epoch(pos.epoch, pos.batch):
            if lr_varies and (new_lr := lr_at(pos.step)) != lr:
                lr = new_lr
                set_lr(opt, lr)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if spec.grad_clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(net.parameters(), spec.grad_clip)
            scaler.step(opt)  # no host sync: fused optimizers read the inf flag on the GPU
            scaler.update()
            pos.step += 1
            pos.batch += 1
            pending.append(loss.detach().float())
            n = len(y) * W
            window["samples"] += n
            samples_seen += n

            log_due = pos.step % spec.log_every_steps == 0
            if log_due or pos.step % sync_every == 0 or (r.stop.signal and not d.ddp):
                bad, stopping = sync()
                if bad is not None:
                    return nonfinite(bad)
                if log_due:
                    log_window()
                report_progress()
                if stopping:
                    return stop_now()
            if every_steps and pos.step % every_steps == 0:
                save_resume()
            if pos.step >= total_steps:
                break

        if pos.batch < spe:  # max_steps reached mid-epoch
            break
        # ---- end of an epoch
        bad, stopping = sync()
        if bad is not None:
            return nonfinite(bad)
        ep = pos.epoch + 1
        if spec.eval_every_epochs and ep % spec.eval_every_epochs == 0:
            evaluate()
            evaluated_at = pos.step
        if spec.checkpoint.every_epochs and ep % spec.checkpoint.every_epochs == 0:
            save_resume()
        report_progress(force=True)
        if stopping:
            return stop_now()
        pos.epoch, pos.batch = ep, 0

    # ---- the end: last metrics, evaluation, resume checkpoint, weights
    bad, stopping = sync()
    if bad is not None:
        return nonfinite(bad)
    if window["n"]:
        log_window()
    if evaluated_at != pos.step:
        evaluate()
    elapsed = time.perf_counter() - attempt_start[0]
    if samples_seen:
        metrics["train/samples_per_s"] = samples_seen / max(elapsed, 1e-9)
    save_resume()
    if main:
        meta = {
            "model": spec.model.name,
            "num_classes": str(ds.num_classes),
            "input_shape": ",".join(map(str, ds.sample_shape)),
            "step": str(pos.step),
        }
        w = export_weights(r.run_dir, net.state_dict(), meta)
        assert w.path == WEIGHTS_FILE
        announce(w, "weights")
        events.emit("finished", step=pos.step, epoch=pos.event_epoch, metrics=dict(metrics))
        r.log(
            f"finished at step {pos.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        )
    barrier(d)
    return exitcodes.OK


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


def _resume_position(pos: Position, ckpt: dict[str, Any]) -> Position:
    pos.step, pos.epoch, pos.batch = (
        int(ckpt["step"]),
        int(ckpt["epoch"]),
        int(ckpt["batch_in_epoch"]),
    )
    return pos


def _relative(path: Path, run_dir: Path) -> str:
    try:
        return str(path.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(path)
