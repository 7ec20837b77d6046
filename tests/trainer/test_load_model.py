"""`torchyard.load_model`: the weights file alone rebuilds a model that takes raw inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sklearn.datasets import load_digits
from trainer_testlib import make_spec, train_in_process, write_cifar

import torchyard


def _val_accuracy(events) -> float:  # type: ignore[no-untyped-def]
    finished = [e for e in events.events if e["type"] == "finished"]
    return float(finished[-1]["metrics"]["val/accuracy"])


def test_a_digits_model_loads_and_scores_on_raw_values(tmp_path: Path) -> None:
    rc, events = train_in_process(
        make_spec(epochs=4, model={"name": "mlp", "hidden": [64]}), tmp_path
    )
    assert rc == 0
    model = torchyard.load_model(tmp_path / "model.safetensors")
    assert not model.training and model.class_names == [str(i) for i in range(10)]
    digits = load_digits()
    raw = torch.from_numpy(digits.images[:, None].astype(np.uint8))  # 0..16, as sklearn holds them
    with torch.no_grad():
        pred = model(raw).argmax(1).numpy()
    accuracy = float((pred == digits.target).mean())
    # The whole set (train and val) fed raw scores at least what the job reported on val.
    assert accuracy >= _val_accuracy(events) - 1e-9 and accuracy > 0.9, accuracy
    assert model(raw[0]).shape == (1, 10)  # one sample
    meta = model.metadata
    assert json.loads(meta["data_spec"])["name"] == "digits"
    assert json.loads(meta["model_spec"])["hidden"] == [64]
    with pytest.raises(ValueError, match=r"shape \[N, 1, 8, 8\]"):
        model(torch.zeros(2, 64))


def test_cifar_class_names_and_normalisation_travel_in_the_file(tmp_path: Path) -> None:
    data = write_cifar(tmp_path / "data", per_batch=20, n_test=20)
    spec = make_spec(data={"name": "cifar10"}, model={"name": "lenet"}, max_steps=2, epochs=1)
    rc, _ = train_in_process(spec, tmp_path / "run", data_root=data)
    assert rc == 0
    model = torchyard.load_model(tmp_path / "run" / "model.safetensors")
    assert model.class_names[0] == "airplane" and len(model.class_names) == 10
    assert model.mean.flatten()[0].item() == pytest.approx(0.4914 * 255)
    x = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    assert model(x).shape == (3, 10)


def test_weights_without_torchyard_metadata_are_explained(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(p), metadata={"step": "3"})
    with pytest.raises(ValueError, match="load_state_dict"):
        torchyard.load_model(p)


def test_a_bundle_model_needs_its_code(tmp_path: Path) -> None:
    code = tmp_path / "proj"
    code.mkdir()
    (code / "nets.py").write_text(
        "from torch import nn\n"
        "def build(in_shape, num_classes, width=8):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Linear(width, num_classes))\n"
    )
    spec = make_spec(model={"name": "nets:build", "args": {"width": 12}}, max_steps=3)
    import sys

    sys.path.insert(0, str(code))
    try:
        rc, _ = train_in_process(spec, tmp_path / "run")
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("nets", None)
    assert rc == 0
    weights = tmp_path / "run" / "model.safetensors"
    with pytest.raises(ValueError, match="pass the bundle's directory"):
        torchyard.load_model(weights)
    model = torchyard.load_model(weights, code=code)
    assert str(code) not in sys.path
    assert model.net[1].out_features == 12
    assert load_file(str(weights)).keys() == {k for k in model.net.state_dict()}
    shutil.rmtree(code)
