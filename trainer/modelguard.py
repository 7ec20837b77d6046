"""The server's size limit for the models the API cannot count: a bundle's `module:function`
factory (and, again, a `torchvision/<name>` model). The worker passes the limit in the
trainer's environment (`TORCHYARD_MAX_MODEL_PARAMS`, the API's setting of the same name);
without it (a trainer run by hand) nothing is checked.

Before the real build, the model is built once on PyTorch's meta device (shapes only,
nothing allocated) and its parameters counted: over the limit, the job fails with an `error`
of kind `model_too_large` (`ModelTooLarge`) and nothing was allocated. The meta build runs
with the CPU random generator and Python's `random` state saved and restored, so the real
build draws the same numbers as without it. A factory that cannot be built on the meta
device (it reads tensor values, moves tensors to a device itself) is built for real under a
guard that counts each parameter as it is registered and stops the build at the first one
past the limit. The factory's own side effects (prints) happen twice.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from torchyard.contracts.datasets import too_many_parameters
from torchyard.trainer.failures import ModelTooLarge

MAX_PARAMS_ENV = "TORCHYARD_MAX_MODEL_PARAMS"


def max_params_from_env() -> int | None:
    """The limit the worker passed (None: not set; a malformed value is the worker's bug)."""
    raw = os.environ.get(MAX_PARAMS_ENV, "").strip()
    if not raw:
        return None
    limit = int(raw)
    if limit < 1:
        raise ValueError(f"{MAX_PARAMS_ENV} must be >= 1, got {raw!r}")
    return limit


def checked_build(build: Callable[[], nn.Module], what: str) -> nn.Module:
    """`build()`'s model, refused with ModelTooLarge before it allocates when it has more
    parameters than the limit in the environment."""
    limit = max_params_from_env()
    if limit is None:
        return build()
    count = meta_count(build)
    if count is not None and count > limit:
        raise ModelTooLarge(too_many_parameters(count, limit, what))
    with parameter_guard(limit, what) as guard:
        try:
            net = build()
        except Exception:
            if guard.refusal is not None:  # wrapped as the user's error, or swallowed and
                raise guard.refusal from None  # followed by another: the limit's
            raise
    if guard.refusal is not None:  # caught inside the user's factory
        raise guard.refusal
    return net


def meta_count(build: Callable[[], nn.Module]) -> int | None:
    """Parameters of `build()`'s model built on the meta device; None when it cannot be
    built there. The random states are left as they were."""
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            net = build()
        if not isinstance(net, nn.Module):
            return None  # the real build says what is wrong with it
        return sum(p.numel() for p in net.parameters())
    except Exception:
        return None
    finally:
        random.setstate(state)


class _Guard(threading.local):
    limit: int | None = None
    what = ""
    total = 0
    seen: dict[int, nn.Parameter]
    refusal: ModelTooLarge | None = None  # once past the limit, every registration raises


_guard = _Guard()
_hook_lock = threading.Lock()
_hook_installed = False


def _on_parameter(_module: nn.Module, _name: str, param: nn.Parameter | None) -> None:
    g = _guard
    if g.limit is None or param is None:
        return
    if g.refusal is None and id(param) not in g.seen:
        g.seen[id(param)] = param  # held, so that no other parameter reuses its id
        g.total += param.numel()
        if g.total > g.limit:
            what = f"{g.what} (stopped while building it)"
            g.refusal = ModelTooLarge(too_many_parameters(g.total, g.limit, what))
    if g.refusal is not None:
        raise g.refusal


@contextmanager
def parameter_guard(limit: int, what: str) -> Iterator[_Guard]:
    """Count the parameters registered in this thread while inside; ModelTooLarge at the
    first that takes the total past `limit` and at every one after (its `refusal`)."""
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            torch_module.register_module_parameter_registration_hook(_on_parameter)
            _hook_installed = True
    g = _guard
    g.limit, g.what, g.seen, g.total, g.refusal = limit, what, {}, 0, None
    try:
        yield g
    finally:
        g.limit, g.seen = None, {}
