"""Optimizers and learning-rate schedules.

A schedule is a pure function of the global optimizer step, so resuming needs no
scheduler state beyond the step itself, and the lr is exact after any restart."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from torchyard.contracts.spec import JobSpec, OptimizerSpec

# onecycle without warmup_steps warms up over this share of the run (OneCycleLR's default).
ONECYCLE_PCT_START = 0.3
ONECYCLE_START_DIV = 25.0
ONECYCLE_FINAL_DIV = 1e4


def _optimizer(spec: JobSpec) -> OptimizerSpec:
    if spec.optimizer is None:  # the spec's own check: only a script job has none
        raise ValueError("a built-in job's spec names an optimizer")
    return spec.optimizer


def build_optimizer(spec: JobSpec, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    o = _optimizer(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    # On CUDA the fused kernels: one launch for all parameters, and GradScaler hands them the
    # scale and inf flag on the GPU (`_step_supports_amp_scaling`), where with foreach or the
    # loop it reads the flag with `.item()`, a host sync every fp16 step. On CPU the
    # per-tensor loop is the fastest.
    kind: dict[str, bool] = {"fused": True} if device.type == "cuda" else {"foreach": False}
    if o.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=o.learning_rate,
            momentum=o.sgd_momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            **kind,
        )
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(params, lr=o.learning_rate, betas=o.adam_betas, weight_decay=o.weight_decay, **kind)


def lr_schedule(spec: JobSpec, total_steps: int) -> Callable[[int], float]:
    """lr(step) for step = optimizer steps already taken (0 for the first update)."""
    peak = _optimizer(spec).learning_rate
    s = spec.schedule
    total = max(total_steps, 1)
    if s.name == "onecycle":
        warm = s.warmup_steps or max(1, int(ONECYCLE_PCT_START * total))
        start, final = peak / ONECYCLE_START_DIV, peak / ONECYCLE_FINAL_DIV

        def onecycle(step: int) -> float:
            if step < warm:
                return start + (peak - start) * step / warm
            t = min(1.0, (step - warm) / max(1, total - warm))
            return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * t))

        return onecycle

    warm = s.warmup_steps
    floor = peak * s.min_lr_fraction

    def scheduled(step: int) -> float:
        if step < warm:
            return peak * (step + 1) / warm
        if s.name == "constant":
            return peak
        t = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return scheduled


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
