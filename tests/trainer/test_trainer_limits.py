"""Size limits the spec alone cannot express: the parameter count of the model and the bytes
the data set takes on the device, estimated without torch, against what torch builds and what
the trainer's data path holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testlib import REPO, make_spec

from torchyard.contracts.datasets import (
    DATASET_CLASSES,
    DATASET_SHAPES,
    data_bytes,
    data_shape,
    limit_problems,
    model_parameters,
)
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.data import load_dataset
from torchyard.trainer.models import build_model

GIB = 1024**3


def synthetic(shape: list[int], classes: int = 10, size: int = 100) -> dict[str, Any]:
    return {"name": "synthetic", "shape": shape, "num_classes": classes, "size": size}


CASES = [
    ({"name": "mlp"}, {"name": "digits"}),
    ({"name": "mlp", "hidden": [300, 100]}, {"name": "mnist"}),
    ({"name": "mlp", "hidden": []}, {"name": "cifar10"}),
    ({"name": "mlp", "hidden": [7, 5, 3]}, synthetic([13], classes=2)),
    ({"name": "mlp", "hidden": [64]}, synthetic([3, 5], classes=100)),
    ({"name": "lenet"}, {"name": "digits"}),  # 8x8: padding 2
    ({"name": "lenet"}, {"name": "fashion_mnist"}),
    ({"name": "lenet"}, {"name": "cifar10"}),
    ({"name": "lenet"}, synthetic([2, 4, 4])),  # the smallest image a conv model takes
    ({"name": "lenet"}, synthetic([1, 15, 31], classes=3)),  # padding by the smaller side
    ({"name": "lenet"}, synthetic([5, 16, 17], classes=7)),
    ({"name": "lenet"}, synthetic([3, 64, 48])),
    ({"name": "resnet18"}, {"name": "cifar10"}),
    ({"name": "resnet18"}, {"name": "mnist"}),
    ({"name": "resnet18"}, synthetic([4, 9, 40], classes=1000)),
]


@pytest.mark.parametrize(("model", "data"), CASES, ids=lambda v: str(v))
def test_parameter_count_is_what_torch_builds(model: dict, data: dict) -> None:
    spec = parse_spec(make_spec(model=model, data=data))
    shape = data_shape(spec.data)
    classes = spec.data.classes if data["name"] == "synthetic" else DATASET_CLASSES[data["name"]]
    net = build_model(spec.model, shape, classes)
    assert model_parameters(spec) == sum(p.numel() for p in net.parameters())


def test_built_in_shapes_match_what_the_readers_give(mnist_root: Path, cifar_root: Path) -> None:
    for name, root in (("digits", None), ("mnist", mnist_root), ("cifar10", cifar_root)):
        ds = load_dataset(parse_spec(make_spec(data={"name": name})).data, root or REPO, 0)
        assert ds.sample_shape == DATASET_SHAPES[name] and ds.num_classes == 10
    assert DATASET_SHAPES["fashion_mnist"] == DATASET_SHAPES["mnist"]


@pytest.mark.parametrize(
    "data", [{"name": "digits", "val_fraction": 0.3}, synthetic([3, 6, 5], size=1001)]
)
def test_data_bytes_are_what_the_device_path_holds(data: dict) -> None:
    # Load it as the trainer does and count what its device path moves: uint8 images, int64 labels.
    spec = parse_spec(make_spec(data=data))
    ds = load_dataset(spec.data, REPO, 0)
    held = 0
    for src in (ds.train, ds.val):
        assert src is not None
        x, y = src.tensors()
        assert x.dtype == torch.uint8 and y.dtype == torch.int64
        held += x.numel() * x.element_size() + y.numel() * y.element_size()
    assert data_bytes(spec.data) == held


def test_known_data_set_sizes() -> None:
    def size(name: str) -> int:
        return data_bytes(parse_spec(make_spec(data={"name": name})).data)

    assert size("digits") == 1797 * (64 + 8)
    assert size("mnist") == size("fashion_mnist") == 70_000 * (784 + 8)
    assert size("cifar10") == 60_000 * (3072 + 8)
    big = parse_spec(make_spec(data=synthetic([16, 1024, 1024], size=10_000_000)))
    assert data_bytes(big.data) == 10_000_000 * (16 * 1024 * 1024 + 8)


def test_the_wide_mlp_is_refused_naming_its_widths() -> None:
    spec = parse_spec(
        make_spec(model={"name": "mlp", "hidden": [65536] * 16}, data={"name": "mnist"})
    )
    n = model_parameters(spec)
    assert n == 784 * 65536 + 15 * 65536**2 + 65536 * 10 + 16 * 65536 + 10  # 64.5 G
    [(field, message)] = limit_problems(spec, 2_000_000_000, 16 * GIB)
    assert field == "model.hidden"
    assert "~64.5 G parameters" in message and "at most 2 G" in message
    assert "TORCHYARD_MAX_MODEL_PARAMS" in message


def test_limits_name_the_field_and_the_variable() -> None:
    lenet = parse_spec(make_spec(model={"name": "lenet"}, data={"name": "cifar10"}))
    n = model_parameters(lenet)  # 62006
    assert limit_problems(lenet, n, data_bytes(lenet.data)) == []  # at the limit is allowed
    [(field, message)] = limit_problems(lenet, n - 1, 16 * GIB)
    assert field == "model" and "~62 K parameters" in message and "at most 62 K" in message
    # an mlp on its default widths: nothing in model.hidden to point at
    mlp = parse_spec(make_spec(model={"name": "mlp"}, data=synthetic([1, 4096, 4096])))
    assert [f for f, _ in limit_problems(mlp, 2_000_000_000, 16 * GIB)] == ["model"]

    big = parse_spec(make_spec(data=synthetic([3, 1024, 1024], size=10_000)))
    problems = limit_problems(big, 2_000_000_000 * 10, 16 * GIB)
    [(field, message)] = problems
    assert field == "data" and "~29.3 GiB" in message and "at most 16 GiB" in message
    assert "TORCHYARD_MAX_DATA_BYTES" in message
    # both at once: every problem in one answer
    assert [f for f, _ in limit_problems(big, 10, 1)] == ["model.hidden", "data"]


def test_the_estimates_do_not_load_torch() -> None:
    code = (
        "import sys; from torchyard.contracts.spec import parse_spec; from torchyard.contracts.datasets import limit_problems; "
        "s = parse_spec({'model': {'name': 'resnet18'}, 'data': {'name': 'cifar10'}, "
        "'optimizer': {'name': 'sgd'}}); limit_problems(s, 1, 1); "
        "print('torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
