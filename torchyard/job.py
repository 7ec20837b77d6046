"""`torchyard.job`: what your own training script uses to run as a torchyard job.

    from torchyard import job

    ctx = job.setup(total_steps=steps)     # rank, world size, device, run dir; steps: the ETA
    state = job.restore()                  # what the last `save` of this job held, or None
    for step in range(start + 1, steps + 1):
        ...                                # your training step
        job.log(step, loss=loss.item())    # metrics: `metric` events (stdout when by hand)
        if step % 100 == 0:
            job.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step}, step)
        if job.should_stop():              # cancelled, or the worker is stopping
            job.save({...}, step)
            break                          # the job resumes later from that save
    job.save_weights(net.state_dict())     # the final model.safetensors
    job.save_artifact("confusion.png")     # any file (or bytes, with a name) kept with the job

Under torchyard (a script job: `entrypoint` in the spec) the runner has already joined the
process group and pinned the device; these calls write the job's events, checkpoints and
weights. Run by hand (`python train.py`, or `torchrun --nproc-per-node=2 train.py`) the same
script works alone: `setup()` joins the process group itself (WORLD_SIZE > 1), metrics are
printed and files go to `./torchyard-run/`.

Rank 0 alone writes; every rank may call every function. Only `should_stop()` is a
collective (under DDP): call it at the same points on every rank.

This module imports torch and the standard library only (safetensors when saving weights by
hand), so that a script needs nothing else of torchyard.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import numbers
import os
import re
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Backend",
    "Context",
    "log",
    "params",
    "restore",
    "save",
    "save_artifact",
    "save_weights",
    "set_total",
    "setup",
    "should_stop",
]

METRIC_NAME = re.compile(r"[a-z0-9_./-]{1,100}")
CHECKPOINT_FORMAT = 1  # as trainer/checkpoint.py writes it: {"format", "step", "state"}
STATE_KEY = "state"
LOCAL_RUN_DIR = "torchyard-run"
LOCAL_KEEP_LAST = 3
PARAMS_ENV = "TORCHYARD_PARAMS"  # job.params() by hand; set by the runner for its children
ARTIFACT_DIR = "artifacts"  # the run dir's folder of save_artifact's files
# As contracts/eventmodel.py's ARTIFACT_NAME (this module imports no torchyard module).
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_PLAIN = (str, int, float, bool, type(None))
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP, torch.compile


@dataclass(frozen=True)
class Context:
    """Where this rank runs: `is_main` (rank 0) is the one that writes."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    run_dir: Path
    is_main: bool


class Backend(Protocol):
    """Where the calls go: the runner's (trainer/script.py) or `_LocalBackend` (by hand).
    Every method gets checked arguments and is called on every rank."""

    def context(self) -> Context: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def save(self, state: dict[str, Any], step: int) -> None: ...

    def save_weights(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def save_artifact(self, source: bytes | Path, name: str) -> None: ...

    def restore(self) -> dict[str, Any] | None: ...

    def set_total(self, total_steps: int) -> None: ...

    def stop_requested(self) -> bool:
        """This rank's own stop flag (no collective)."""
        ...

    def stopping(self) -> None:
        """`should_stop()` is returning True: the script is about to stop early."""
        ...

    def params(self) -> dict[str, Any]:
        """The run's parameters (`params()` copies them)."""
        ...


_backend: Backend | None = None
_lock = threading.Lock()


def _install(backend: Backend | None) -> None:
    """The runner's hook: route every call to `backend` (None: back to the local one)."""
    global _backend
    with _lock:
        _backend = backend


def _get() -> Backend:
    global _backend
    with _lock:
        if _backend is None:
            _backend = _LocalBackend()
        return _backend


# ---------------------------------------------------------------------------- the API


def setup(total_steps: int | None = None) -> Context:
    """This rank's context. Under torchyard: what the runner set up (process group joined,
    device pinned). By hand: joins the process group when WORLD_SIZE > 1 (NCCL on CUDA,
    gloo on CPU, env:// rendezvous as torchrun sets it), picks `cuda:LOCAL_RANK` (or the
    CPU), creates ./torchyard-run/ and makes SIGTERM set the stop flag. Calling it again
    returns the same context; the other functions call it when the script has not.
    `total_steps`: the run's length, as `set_total` takes it."""
    b = _get()
    if total_steps is not None:
        set_total(total_steps)
    return b.context()


def set_total(total_steps: int) -> None:
    """The run's length: the step the last `log` will be at. The job then shows `step/total`
    and an ETA, as a built-in job does (without it: `step/?` while it runs, and its last
    step as the length once it finishes). Call it again if the length changes."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral):
        raise TypeError(f"job.set_total: total_steps must be an integer >= 1, not {total_steps!r}")
    if total_steps < 1:
        raise ValueError(f"job.set_total: total_steps must be >= 1, not {total_steps}")
    _get().set_total(int(total_steps))


def log(step: int, **metrics: float) -> None:
    """Record metrics at `step`: `job.log(step, loss=0.31)`, or `job.log(step,
    **{"val/accuracy": acc})`. Names: 1 to 100 of `a-z 0-9 _ . / -` (ValueError); values:
    real numbers, not bool nor tensors (TypeError: use `.item()`). Rank 0 records them:
    `metric` events under torchyard, a `step N name=value` line by hand."""
    _check_step(step, "log")
    clean: dict[str, float] = {}
    for name, value in metrics.items():
        if not METRIC_NAME.fullmatch(name):
            raise ValueError(
                f"job.log: metric name {name!r} must be 1 to 100 of a-z, 0-9, '_', '.', '/', '-'"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            hint = " (a tensor: pass .item())" if isinstance(value, torch.Tensor) else ""
            raise TypeError(
                f"job.log: metric {name!r} must be a real number, not {type(value).__name__}{hint}"
            )
        clean[name] = int(value) if isinstance(value, numbers.Integral) else float(value)
    _get().log(step, clean)


def save(state: dict[str, Any], step: int) -> None:
    """A resume checkpoint of `state` at `step`, written atomically by rank 0 (the other ranks
    return at once: no collective, so calling it on rank 0 alone also works). `state` may
    hold tensors and plain values only (dict, list, tuple, str, int, float, bool, None,
    nested), so that it loads with `torch.load(weights_only=True)`: anything else is a
    TypeError naming its key path, raised before anything is written. Under torchyard the
    job keeps `checkpoint.keep_last` of them; by hand ./torchyard-run/checkpoints/ keeps 3."""
    _check_step(step, "save")
    if not isinstance(state, dict):
        raise TypeError(f"job.save: state must be a dict, not {type(state).__name__}")
    check_plain(state, "state")
    _get().save(state, step)


def save_weights(state_dict: Mapping[str, torch.Tensor]) -> None:
    """The final weights, `model.safetensors` in the run dir (rank 0). A leading `module.`
    (DDP) or `_orig_mod.` (torch.compile) is dropped from every key, so the file loads into
    the bare model."""
    _get().save_weights(bare_weights(state_dict))


def save_artifact(path_or_bytes: str | os.PathLike[str] | bytes, name: str | None = None) -> None:
    """Keep a file with the job: a plot, a confusion matrix, a config. `path_or_bytes` is a
    file to copy, or the bytes themselves; `name` (the file's own name by default; needed
    with bytes) is 1 to 128 of `A-Z a-z 0-9 . _ -`, not starting with a dot (ValueError).
    Rank 0 writes it atomically to `artifacts/<name>` of the run dir (saving a name again
    replaces it; the other ranks return at once). Under torchyard the job's page lists it
    and shows it when it is a PNG, JPEG, GIF or WebP image (`torchyard artifacts JOB`);
    it counts in the run directory's size limit. By hand: ./torchyard-run/artifacts/."""
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        source: bytes | Path = bytes(path_or_bytes)
        if name is None:
            raise ValueError("job.save_artifact: name= is needed when saving bytes")
    elif isinstance(path_or_bytes, str | os.PathLike):
        source = Path(path_or_bytes)
        if not source.is_file():
            raise FileNotFoundError(f"job.save_artifact: no such file: {str(source)!r}")
        name = source.name if name is None else name
    else:
        raise TypeError(
            "job.save_artifact: pass a file path or bytes, not " + type(path_or_bytes).__name__
        )
    if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
        raise ValueError(
            f"job.save_artifact: name {name!r} must be 1 to 128 of A-Z, a-z, 0-9, '.', '_', "
            "'-', not starting with '.'"
        )
    _get().save_artifact(source, name)


def restore() -> dict[str, Any] | None:
    """The state last passed to `save` in this job (after a preemption, a lost attempt or a
    restart), on the CPU, or None when there is none. Call it once, before training: under
    torchyard it is the checkpoint this attempt starts from; by hand the newest file in
    ./torchyard-run/checkpoints/."""
    return _get().restore()


def should_stop() -> bool:
    """True once the job is being stopped: cancelled, the worker shutting down (SIGTERM) or
    its lease lost. Save and return then; the job resumes from that save later.

    Under DDP (world_size > 1) this is a collective, one all_reduce of the flag: every rank
    must call it at the same points (e.g. once per step), and every rank gets the same
    answer, so no rank stops while another waits in a collective. With one rank it costs
    nothing."""
    b = _get()
    ctx = b.context()
    stop = b.stop_requested()
    if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1.0 if stop else 0.0], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        stop = bool(flag.item() > 0)
    if stop:
        b.stopping()
    return stop


def params() -> dict[str, Any]:
    """The run's parameters, a new dict each call: `lr = job.params().get("lr", 0.01)`.
    Under torchyard: the spec's `params` object (`{"lr": 0.1, "arch": "wide"}`), with a
    sweep trial's values for `params.<name>` already in it; {} when the spec has none. A
    process the script starts reads the same (the runner sets TORCHYARD_PARAMS). By hand:
    the JSON object in the environment variable TORCHYARD_PARAMS
    (`TORCHYARD_PARAMS='{"lr": 0.1}' python train.py`), or {} when it is unset."""
    return dict(_get().params())


def params_from_env() -> dict[str, Any]:
    """TORCHYARD_PARAMS as a dict ({} when unset or empty); ValueError naming it otherwise."""
    raw = os.environ.get(PARAMS_ENV, "").strip()
    if not raw:
        return {}
    try:
        found = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{PARAMS_ENV} must hold a JSON object: {e}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{PARAMS_ENV} must hold a JSON object, not {type(found).__name__}")
    return found


# ---------------------------------------------------------------------------- checks


def _check_step(step: Any, what: str) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(f"job.{what}: step must be an integer >= 0, not {step!r}")


def check_plain(value: Any, path: str) -> None:
    """TypeError naming the key path (`state['opt']['fn']`) of the first value that
    `torch.load(weights_only=True)` could not read back."""
    t = type(value)
    if t in _PLAIN or isinstance(value, torch.Tensor):
        return
    if t in (dict, OrderedDict):
        for k, v in value.items():
            if type(k) not in _PLAIN:
                raise TypeError(
                    f"job.save: {path} has a key of type {type(k).__name__}: keys must be "
                    "str, int, float, bool or None"
                )
            check_plain(v, f"{path}[{k!r}]")
        return
    if t in (list, tuple):
        for i, v in enumerate(value):
            check_plain(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"job.save: {path} is a {t.__module__}.{t.__qualname__}: a checkpoint holds tensors "
        "and plain values only (dict, list, tuple, str, int, float, bool, None); save its "
        "state_dict() instead"
    )


def bare_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors by key without the DDP/compile wrappers' prefixes, detached."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"job.save_weights: {key!r} is a {type(value).__name__}, not a tensor")
        bare = key
        while bare.startswith(_WRAPPER_PREFIXES):
            bare = bare.split(".", 1)[1]
        if bare in out:
            raise ValueError(f"job.save_weights: two tensors are named {bare!r}")
        out[bare] = value.detach()
    return out


def unshared_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with its own storage (safetensors refuses tied weights)."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        t = t.contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def checkpoint_file(directory: Path, step: int) -> Path:
    """checkpoints/step-XXXXXXXX.pt: the name the trainer and the worker look for."""
    return directory / f"step-{step:08d}.pt"


def read_state(path: Path) -> dict[str, Any]:
    """The state a checkpoint of `save` holds (tensors on the CPU, weights_only)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if (
        not isinstance(ckpt, dict)
        or ckpt.get("format") != CHECKPOINT_FORMAT
        or not isinstance(ckpt.get(STATE_KEY), dict)
    ):
        raise ValueError(f"{path}: not a checkpoint written by torchyard.job.save")
    return ckpt[STATE_KEY]


# ---------------------------------------------------------------------------- by hand


class _LocalBackend:
    """`python train.py` or a local torchrun: everything under ./torchyard-run/."""

    def __init__(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=timedelta(minutes=10),
            )
        run_dir = Path.cwd() / LOCAL_RUN_DIR
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ctx = Context(rank, world, local, device, run_dir, rank == 0)
        self.stop_signal: str | None = None
        self._catch_sigterm()

    def _catch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        before = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            self.stop_signal = self.stop_signal or "SIGTERM"
            if callable(before):
                before(signum, frame)

        signal.signal(signal.SIGTERM, handler)

    def context(self) -> Context:
        return self.ctx

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.ctx.is_main:
            parts = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            print(f"step {step} {parts}".rstrip(), flush=True)

    def save(self, state: dict[str, Any], step: int) -> None:
        if not self.ctx.is_main:
            return
        buf = io.BytesIO()
        torch.save({"format": CHECKPOINT_FORMAT, "step": step, STATE_KEY: state}, buf)
        folder = self.ctx.run_dir / "checkpoints"
        final = checkpoint_file(folder, step)
        write_file_atomic(final, buf.getbuffer())
        for old in _checkpoints(folder)[:-LOCAL_KEEP_LAST]:
            if old != final:
                old.unlink(missing_ok=True)

    def save_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.ctx.is_main:
            return
        from safetensors.torch import save as safetensors_save

        write_file_atomic(
            self.ctx.run_dir / "model.safetensors", safetensors_save(unshared_cpu(tensors))
        )

    def save_artifact(self, source: bytes | Path, name: str) -> None:
        if self.ctx.is_main:
            write_artifact(self.ctx.run_dir, name, source)

    def restore(self) -> dict[str, Any] | None:
        found = _checkpoints(self.ctx.run_dir / "checkpoints")
        return read_state(found[-1]) if found else None

    def set_total(self, total_steps: int) -> None:
        pass  # by hand the step lines are the progress

    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    def stopping(self) -> None:
        pass

    def params(self) -> dict[str, Any]:
        return params_from_env()


def _fmt(v: float) -> str:
    return str(v) if isinstance(v, int) or not math.isfinite(v) else f"{v:.6g}"


def _checkpoints(folder: Path) -> list[Path]:
    """step-*.pt files, oldest step first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := re.fullmatch(r"step-(\d{8,})\.pt", p.name))]  # fmt: skip
    return [p for _, p in sorted(found)]


def write_artifact(run_dir: Path, name: str, source: bytes | Path) -> tuple[int, str]:
    """`source` (bytes, or a file copied block by block) to run_dir/artifacts/<name>, as
    `write_file_atomic` writes; (bytes, sha256) of what was written."""
    h, n = hashlib.sha256(), 0

    def fill(f: BinaryIO) -> None:
        nonlocal n
        if isinstance(source, bytes):
            f.write(source)
            h.update(source)
            n = len(source)
            return
        with source.open("rb") as src:
            while block := src.read(1 << 20):
                f.write(block)
                h.update(block)
                n += len(block)

    _atomic(run_dir / ARTIFACT_DIR / name, fill)
    return n, h.hexdigest()


def write_file_atomic(final: Path, data: bytes | memoryview) -> None:
    """temp file, fsync, rename, fsync the directory: the name only ever holds a whole file."""
    _atomic(final, lambda f: f.write(data))


def _atomic(final: Path, fill: Callable[[BinaryIO], Any]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sys.platform != "win32":
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
