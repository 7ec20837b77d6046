"""Resume checkpoints and the final weights, written so that only complete files exist.

A file is serialised in memory, hashed, written to a temporary name, fsynced, renamed
over its final name and the directory fsynced; only then is it announced. A resume
checkpoint holds everything a run needs to continue where it stopped: model, optimizer,
GradScaler, step, epoch, position in the epoch and every RNG state of every rank.

How exact that is, by where it runs (the same world size and thread count assumed):
- CPU: bit for bit, always.
- GPU with `deterministic: true` in the spec: bit for bit (deterministic kernels, no cuDNN
  autotuning, no TF32; trainer/loop.py: set_determinism).
- GPU otherwise: the same data order, learning rates and RNG streams, but cuDNN's timed
  kernel choice, TF32 and atomic adds round differently from run to run, so a resumed run
  matches an uninterrupted one only to rounding (as two uninterrupted runs do). It
holds only tensors and plain types, so `torch.load(weights_only=True)` reads it back.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

from torchyard.job import write_file_atomic

CHECKPOINT_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
# The metadata layout of WEIGHTS_FILE that `torchyard.load_model` reads (trainer/loop.py).
WEIGHTS_FORMAT = "torchyard-weights/1"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_DIR}/step-{step:08d}.pt"


@dataclass(frozen=True)
class Written:
    path: str  # relative to the run dir
    bytes: int
    sha256: str


def write_atomic(run_dir: Path, relative: str, data: bytes | memoryview) -> Written:
    """Write `data` to run_dir/relative so that the name only ever holds a complete file
    (temp file, fsync, rename, fsync the directory: torchyard.job's writer, which scripts
    use by hand too)."""
    write_file_atomic(run_dir / relative, data)
    return Written(relative, len(data), hashlib.sha256(data).hexdigest())


# ---------------------------------------------------------------------------- RNG


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as tensors and plain types."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: (name, keys, pos, has_gauss, gauss)
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": py_state[0],
            "state": torch.tensor(py_state[1], dtype=torch.int64),
            "gauss": py_state[2],
        },
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------- resume checkpoints


def save_checkpoint(run_dir: Path, step: int, payload: dict[str, Any]) -> Written:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, **payload}, buf)
    return write_atomic(run_dir, checkpoint_name(step), buf.getbuffer())


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a resume checkpoint: tensors and plain types only (weights_only=True)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path}: not a torchyard checkpoint (format {FORMAT})")
    return ckpt


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete resume checkpoints in the run dir as (step, path), oldest step first."""
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune(run_dir: Path, keep_last: int, just_written: str) -> list[str]:
    """Delete all but the `keep_last` newest resume checkpoints (never the one just written);
    return the deleted paths, relative to the run dir."""
    others = [p for _, p in list_checkpoints(run_dir) if p != run_dir / just_written]
    doomed = others[: max(0, len(others) - (keep_last - 1))]
    for p in doomed:
        p.unlink(missing_ok=True)
    return [f"{CHECKPOINT_DIR}/{p.name}" for p in doomed]


# ---------------------------------------------------------------------------- final weights


def export_weights(
    run_dir: Path, state_dict: dict[str, torch.Tensor], meta: dict[str, str]
) -> Written:
    """The trained weights as safetensors (loadable without pickle)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    return write_atomic(run_dir, WEIGHTS_FILE, safetensors_save(tensors, metadata=meta))


# ---------------------------------------------------------------------------- warm start


def init_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a file the spec's `init` names: final weights (safetensors) or a
    resume checkpoint's model (weights_only). Not its optimizer: a warm start, not a resume."""
    from safetensors.torch import load_file

    from torchyard.trainer.failures import InitError

    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    ckpt = load_checkpoint(path)
    model = ckpt.get("model")
    if not isinstance(model, dict):
        raise InitError(f"{path.name}: a checkpoint without model weights (a script job's?)")
    return model


def load_init(net: torch.nn.Module, path: Path) -> None:
    """Start `net` from the weights in `path`, or InitError naming every tensor that does
    not fit (missing, unexpected, or of another shape)."""
    from torchyard.trainer.failures import InitError

    state, mine = init_state(path), net.state_dict()
    problems = [f"missing {k}" for k in mine if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in mine]
    problems += [
        f"{k}: {list(v.shape)} in the checkpoint, {list(mine[k].shape)} in this model"
        for k, v in state.items()
        if k in mine and v.shape != mine[k].shape
    ]
    if problems:
        shown = "; ".join(problems[:20]) + ("; …" if len(problems) > 20 else "")
        raise InitError(f"the init weights do not fit this model: {shown}")
    net.load_state_dict(state)
