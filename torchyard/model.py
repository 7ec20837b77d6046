"""`torchyard.load_model`: a trained job's `model.safetensors` back as a ready `nn.Module`.

The file's metadata (written by the trainer, `trainer/loop.py: weights_metadata`) holds
the job's model and data specs, the input normalisation and the class names, so nothing
else is needed: the model is rebuilt with the trainer's own code, its weights loaded
(strictly: every tensor must fit), and it is wrapped so that it takes inputs as the data
set's files hold them (uint8 pixels, digits' 0..16 values) and normalises them itself.

    import torchyard
    model = torchyard.load_model("model.safetensors")   # eval mode, on the CPU
    logits = model(images)                              # [N, C, H, W] or one [C, H, W]
    print(model.class_names[logits.argmax(1)[0]])

A model from a code bundle (`model.name: module:function`) needs the bundle's directory:
`load_model(path, code="my_project/")`. Loading never unpickles anything.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchyard.contracts.spec import ModelSpec
from torchyard.trainer.checkpoint import WEIGHTS_FORMAT
from torchyard.trainer.models import build_model

# Wrappers that prefix a model's state dict keys (torch.compile, DDP).
_PREFIXES = ("_orig_mod.", "module.")


class TrainedModel(nn.Module):
    """The trained network behind the trainer's input normalisation."""

    def __init__(
        self,
        net: nn.Module,
        mean: list[float],
        std: list[float],
        class_names: list[str],
        in_shape: tuple[int, ...],
        metadata: dict[str, str],
    ):
        super().__init__()
        self.net = net
        view = (1, len(mean)) + (1,) * (len(in_shape) - 1) if len(in_shape) > 1 else (1, -1)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(view))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(view))
        self.class_names = class_names
        self.in_shape = in_shape
        self.metadata = metadata

    def forward(self, x: Any) -> torch.Tensor:
        x = torch.as_tensor(x)
        if x.dim() == len(self.in_shape):  # one sample
            x = x.unsqueeze(0)
        if tuple(x.shape[1:]) != self.in_shape:
            raise ValueError(
                f"expected inputs of shape [N, {', '.join(map(str, self.in_shape))}] as the "
                f"data set's files hold them, got {list(x.shape)}"
            )
        x = x.to(self.mean.device, torch.float32)
        return self.net((x - self.mean) / self.std)


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


@contextmanager
def _on_path(code: str | os.PathLike[str] | None) -> Iterator[None]:
    if code is None:
        yield
        return
    top = str(Path(code).resolve())
    sys.path.insert(0, top)
    try:
        yield
    finally:
        if top in sys.path:
            sys.path.remove(top)


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for k, v in load_file(str(path)).items():
        for p in _PREFIXES:
            k = k.removeprefix(p)
        out[k] = v
    return out


def load_model(
    path: str | os.PathLike[str], *, code: str | os.PathLike[str] | None = None
) -> TrainedModel:
    """The model of a job's `model.safetensors`, in eval mode on the CPU, taking raw inputs
    (see the module's doc). `code`: the directory of the job's code bundle, for a model
    built by the bundle's own `module:function`."""
    p = Path(path)
    meta = _metadata(p)
    if meta.get("format") != WEIGHTS_FORMAT:
        raise ValueError(
            f"{p} was not written by torchyard's training loop (or by a version before "
            f"{WEIGHTS_FORMAT}): it holds the weights only. A script job's weights load "
            "into your own model: model.load_state_dict(safetensors.torch.load_file(path))"
        )
    spec = ModelSpec.model_validate(json.loads(meta["model_spec"]))
    if spec.kind == "factory" and code is None:
        raise ValueError(
            f"the model is built by the job's own code ({spec.name}): pass the bundle's "
            "directory, load_model(path, code='path/to/project')"
        )
    in_shape = tuple(int(d) for d in meta["input_shape"].split(","))
    with _on_path(code):
        net = build_model(spec, in_shape, int(meta["num_classes"]))
    net.load_state_dict(_state(p), strict=True)
    norm = json.loads(meta["normalize"])
    names = json.loads(meta["class_names"])
    return TrainedModel(net, norm["mean"], norm["std"], names, in_shape, meta).eval()
