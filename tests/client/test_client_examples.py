"""Every example spec is valid against the job spec, and covers the cases it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchyard.client.sdk import load_spec
from torchyard.contracts.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# file -> what it must show
CASES = {
    "digits.json": {"data": "digits"},
    "synthetic.json": {"data": "synthetic"},
    "mlp_mnist.json": {"data": "mnist", "model": "mlp"},
    "lenet_cifar10.yaml": {"data": "cifar10", "model": "lenet"},
    "resnet18_cifar10_amp.yaml": {"precision": ("fp16", "bf16")},
    "ddp_2gpu_cifar10.yaml": {"world_size": 2},
}


def test_every_example_file_is_in_the_table() -> None:
    on_disk = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".json", ".yaml", ".yml")}
    assert on_disk == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_is_valid_and_shows_its_case(name: str) -> None:
    spec = parse_spec(load_spec(EXAMPLES / name))
    want = CASES[name]
    if "data" in want:
        assert spec.data.name == want["data"]
    if "model" in want:
        assert spec.model.name == want["model"]
    if "precision" in want:
        assert spec.precision in want["precision"]
    if "world_size" in want:
        assert spec.world_size == want["world_size"]
        assert spec.batch_size % spec.world_size == 0
