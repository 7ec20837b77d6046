"""Hostile tenants and model size in the trainer (issue 25, "The size limit skips ..."): a
bundle's `module:function` model, which the API cannot build, is counted by the trainer
before it is allocated, against TORCHYARD_MAX_MODEL_PARAMS (the worker passes it in the
trainer's environment): the job fails with an `error` of kind `model_too_large`, not an
out-of-memory or a host killed by one. In this process, CPU."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_testlib import make_spec, train_in_process

from torchyard.contracts import exitcodes
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.failures import ModelTooLarge, classify
from torchyard.trainer.modelguard import MAX_PARAMS_ENV
from torchyard.trainer.models import build_model

pytestmark = pytest.mark.hostile

HUGE = """
import math, random
from torch import nn
import torch

def huge(in_shape, num_classes, width=1 << 20):
    # ~1 T parameters: 4 TiB as fp32, never to be allocated
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width),
                         nn.Linear(width, width), nn.Linear(width, num_classes))

def reads_values(in_shape, num_classes, width=2048, layers=64):
    # cannot be built on the meta device: it reads a tensor's value
    width = int(torch.tensor([width]).item())
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width),
                         *[nn.Linear(width, width) for _ in range(layers)],
                         nn.Linear(width, num_classes))

def swallows(in_shape, num_classes, width=2048, layers=64):
    # catches whatever stops it, and goes on
    width = int(torch.tensor([width]).item())
    out = [nn.Flatten()]
    for _ in range(layers):
        try:
            out.append(nn.Linear(width, width))
        except Exception:
            pass
    return nn.Sequential(*out)

def small(in_shape, num_classes, width=16):
    random.random()  # the user's own use of Python's random numbers
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width),
                         nn.Linear(width, num_classes))
"""


@pytest.fixture
def bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "hugemodels.py").write_text(HUGE)
    monkeypatch.syspath_prepend(str(d))
    sys.modules.pop("hugemodels", None)
    return d


def _model(name: str, **args: object) -> dict:
    return {"name": name, "args": args} if args else {"name": name}


def test_a_bundle_model_over_the_limit_fails_as_model_too_large_before_allocating(
    tmp_path: Path, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the trainer allocated it (an OOM of the job, or of the host)."""
    monkeypatch.setenv(MAX_PARAMS_ENV, "2000000000")
    spec = make_spec(model=_model("hugemodels:huge"), epochs=1)
    started = time.monotonic()
    code, ev = train_in_process(spec, tmp_path / "run")
    assert time.monotonic() - started < 30
    (err,) = ev.of_type("error")
    assert code == exitcodes.FAILED and err["kind"] == "model_too_large", err
    assert "model hugemodels:huge has ~1.1 T parameters" in err["message"]
    assert "at most 2 G (TORCHYARD_MAX_MODEL_PARAMS)" in err["message"]


def test_a_model_that_cannot_be_built_on_meta_is_stopped_while_building(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_PARAMS_ENV, "10000000")  # 10 M; the model is ~269 M
    spec = parse_spec(make_spec(model=_model("hugemodels:reads_values")))
    with pytest.raises(ModelTooLarge) as e:
        build_model(spec.model, (1, 8, 8), 10)
    assert "stopped while building it" in str(e.value)
    assert classify(e.value, bundle) == ("model_too_large", exitcodes.FAILED)
    # a factory that catches the guard's exception is refused all the same
    spec = parse_spec(make_spec(model=_model("hugemodels:swallows")))
    with pytest.raises(ModelTooLarge):
        build_model(spec.model, (1, 8, 8), 10)
    # without the limit in the environment (a trainer run by hand) nothing is checked
    monkeypatch.delenv(MAX_PARAMS_ENV)
    small = parse_spec(make_spec(model=_model("hugemodels:reads_values", layers=1, width=8)))
    assert build_model(small.model, (1, 8, 8), 10) is not None


def test_a_torchvision_model_over_the_limit_is_refused_by_the_trainer_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MAX_PARAMS_ENV, "2000000000")
    model = {"name": "torchvision/resnet50", "args": {"width_per_group": 65536}}
    spec = parse_spec(make_spec(model=model))
    with pytest.raises(ModelTooLarge, match=r"torchvision/resnet50 has ~11\.9 T parameters"):
        build_model(spec.model, (3, 32, 32), 10)


def test_the_count_leaves_the_weights_and_random_numbers_as_they_were(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    spec = parse_spec(make_spec(model=_model("hugemodels:small")))

    def built() -> tuple[list[torch.Tensor], float, float]:
        torch.manual_seed(0)
        random.seed(0)
        net = build_model(spec.model, (1, 8, 8), 10)
        return [p.detach().clone() for p in net.parameters()], torch.rand(1).item(), random.random()

    plain = built()
    monkeypatch.setenv(MAX_PARAMS_ENV, "1000000")
    counted = built()
    assert all(torch.equal(a, b) for a, b in zip(plain[0], counted[0], strict=True))
    assert plain[1:] == counted[1:]
