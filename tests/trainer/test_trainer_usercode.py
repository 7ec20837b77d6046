"""Your model and your data in torchyard's loop (in this process, CPU): `module:function`
factories from a bundle on sys.path, `torchvision/<name>`, `imagefolder/<dir>`, warm starts
from another job's weights, and how the user's mistakes end a job (error kind user_code)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from trainer_testlib import REPO, make_spec, train_in_process

from torchyard.contracts import exitcodes
from torchyard.contracts.spec import parse_spec

BUNDLE_MODEL = """
import math
from torch import nn

def build(in_shape, num_classes, width=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))

def broken(in_shape, num_classes):
    raise RuntimeError("my model is broken")

def not_a_module(in_shape, num_classes):
    return "a string"

class WrongShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 3)

    def forward(self, x):
        return self.lin(x.flatten(1))  # digits has 64 features, not 7

def wrong_shapes(in_shape, num_classes):
    return WrongShapes()

def torch_only(in_shape, num_classes):
    return nn.Sequential(nn.Linear(64, 10))  # no Flatten: digits' [1, 8, 8] is 8 wide
"""
BUNDLE_DATA = """
import torch

class Blobs(torch.utils.data.Dataset):
    def __init__(self, n, dim, k, seed, label_shift=0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(k, (n,), generator=g)
        centers = torch.randn(k, dim, generator=torch.Generator().manual_seed(99)) * 3
        self.x = centers[self.y] + torch.randn(n, dim, generator=g)
        self.shift = label_shift

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i]) + self.shift

SEEN_ROOT = []

def build(root, n=256, dim=8, k=3):
    SEEN_ROOT.append(root)
    return Blobs(n, dim, k, 0), Blobs(n // 4, dim, k, 1), k

def bad_labels(root):
    return Blobs(64, 4, 3, 0, label_shift=5), None, 3

def two_things(root):
    return [1, 2, 3], 3
"""


@pytest.fixture
def bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A code bundle first on sys.path, as trainer/cli.py puts it (fresh module names)."""
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "mymodels.py").write_text(BUNDLE_MODEL)
    (d / "mydata.py").write_text(BUNDLE_DATA)
    monkeypatch.syspath_prepend(str(d))
    for name in ("mymodels", "mydata"):
        sys.modules.pop(name, None)
    return d


def _error(events) -> dict:
    (err,) = events.of_type("error")
    return err


def test_bundle_model_on_bundle_data_trains(tmp_path: Path, bundle: Path) -> None:
    spec = make_spec(model={"name": "mymodels:build", "args": {"width": 24}},
                     data={"name": "mydata:build", "args": {"dim": 6}, "num_workers": 0},
                     epochs=3, batch_size=32)  # fmt: skip
    code, ev = train_in_process(spec, tmp_path / "run", data_root=tmp_path / "data")
    assert code == exitcodes.OK, ev.of_type("error")
    started = ev.of_type("started")[0]
    assert started["loader"] == "dataloader" and started["train_samples"] == 256
    w = load_file(str(tmp_path / "run/model.safetensors"))
    assert w["1.weight"].shape == (24, 6) and w["3.weight"].shape == (3, 24)
    assert ev.of_type("finished")[0]["metrics"]["val/accuracy"] > 0.8
    seen = sys.modules["mydata"].SEEN_ROOT
    assert seen == [tmp_path / "data"]


def test_torchvision_model_on_synthetic_images(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "torchvision/mobilenet_v3_small"}, max_steps=2,
                     batch_size=8, epochs=1, eval_every_epochs=0,
                     data={"name": "synthetic", "shape": [3, 32, 32], "size": 40,
                           "num_classes": 4})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.OK, ev.of_type("error")
    w = load_file(str(tmp_path / "model.safetensors"))
    assert w["classifier.3.weight"].shape[0] == 4


def test_unknown_torchvision_model_is_a_spec_error(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "torchvision/resnet_9000"})
    code, ev = train_in_process(spec, tmp_path)
    err = _error(ev)
    assert code == exitcodes.FAILED and err["kind"] == "spec"
    assert "resnet_9000" in err["message"] and "mobilenet_v3_small" in err["message"]


def _write_png_folder(root: Path, per_class: int = 6) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, colour in enumerate(((200, 30, 30), (30, 30, 200))):
            d = root / "shapes" / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                px = np.clip(rng.normal(colour, 25, (40, 48, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(px).save(d / f"{i}.png")


def test_imagefolder_of_png_files(tmp_path: Path) -> None:
    _write_png_folder(tmp_path / "data")
    spec = make_spec(model={"name": "lenet"}, epochs=2, batch_size=4,
                     data={"name": "imagefolder/shapes", "image_size": 24, "num_workers": 0})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path / "run", data_root=tmp_path / "data")
    assert code == exitcodes.OK, ev.of_type("error")
    started = ev.of_type("started")[0]
    assert (started["train_samples"], started["val_samples"]) == (12, 12)
    w = load_file(str(tmp_path / "run/model.safetensors"))
    assert w["features.0.weight"].shape[1] == 3 and w["classifier.4.weight"].shape[0] == 2
    assert ev.of_type("finished")[0]["metrics"]["val/accuracy"] >= 0.5


def test_imagefolder_missing_is_a_data_error(tmp_path: Path) -> None:
    spec = make_spec(data={"name": "imagefolder/nothere"})
    code, ev = train_in_process(spec, tmp_path / "run", data_root=tmp_path)
    err = _error(ev)
    assert (code, err["kind"]) == (exitcodes.FAILED, "data")
    assert str(tmp_path / "nothere" / "train") in err["message"]


@pytest.mark.parametrize(
    ("model", "data", "says"),
    [
        ("mymodels:broken", "digits", "RuntimeError: my model is broken"),
        # Raised inside torch, below the user's forward: the user's all the same.
        ("mymodels:wrong_shapes", "digits", "mat1 and mat2 shapes cannot be multiplied"),
        ("mymodels:not_a_module", "digits", "returned str, not a torch.nn.Module"),
        ("mymodels:missing", "digits", "has no function 'missing'"),
        ("nosuchmodule:build", "digits", "no module 'nosuchmodule'"),
        ("mlp", "mydata:two_things", "not (train_dataset, val_dataset, num_classes)"),
        ("mlp", "mydata:bad_labels", "not in 0..2"),
    ],
)
def test_user_code_errors_fail_the_job_as_user_code(
    tmp_path: Path, bundle: Path, capsys: pytest.CaptureFixture[str], model: str, data: str,
    says: str,
) -> None:  # fmt: skip
    spec = make_spec(model={"name": model}, data={"name": data, "num_workers": 0})
    code, ev = train_in_process(spec, tmp_path / "run")
    err = _error(ev)
    assert (code, err["kind"]) == (exitcodes.FAILED, "user_code")
    assert says in err["message"]
    err_text = capsys.readouterr().err
    if model == "mymodels:broken":  # the user's own traceback reaches the job log
        assert 'in broken\n    raise RuntimeError("my model is broken")' in err_text
    if model == "mymodels:wrong_shapes":
        assert "in forward\n    return self.lin(x.flatten(1))" in err_text


def test_a_torch_only_user_model_failing_its_first_step_is_user_code(
    tmp_path: Path, bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The factory only built torch modules: no frame of the user's file in the traceback,
    and still their model's shape mismatch, which would fail every retry the same way."""
    spec = make_spec(model={"name": "mymodels:torch_only"}, batch_size=128)
    code, ev = train_in_process(spec, tmp_path / "run")
    err = _error(ev)
    assert (code, err["kind"], err["step"]) == (exitcodes.FAILED, "user_code", 0)
    assert err["message"] == (
        "model mymodels:torch_only failed in its first training step: RuntimeError: mat1 and "
        "mat2 shapes cannot be multiplied (1024x8 and 64x10)"
    )
    assert "user code failed while running the first training step" in capsys.readouterr().err


def _linear_raises(monkeypatch: pytest.MonkeyPatch, error: Exception, eval_only: bool) -> None:
    """Every nn.Linear fails (in evaluation alone: under no_grad), raised from torch's frames
    and this file's, never a bundle's."""

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if eval_only and torch.is_grad_enabled():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        raise error

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)


SHAPES = "mat1 and mat2 shapes cannot be multiplied (1024x8 and 64x10)"


@pytest.mark.parametrize(
    ("model", "error", "eval_only", "kind"),
    [
        ("mymodels:build", RuntimeError(SHAPES), True, "user_code"),  # its first evaluation
        ("mlp", RuntimeError(SHAPES), False, "internal"),  # our model: our bug, retried
        # Faults of the machine keep their kinds, whoever's model was running.
        ("mymodels:build", RuntimeError("CUDA error: an illegal memory access"), False,
         "internal"),
        ("mymodels:build", torch.OutOfMemoryError("CUDA out of memory"), False,
         "out_of_memory"),
    ],
)  # fmt: skip
def test_first_pass_failures_by_whose_model(
    tmp_path: Path, bundle: Path, monkeypatch: pytest.MonkeyPatch, model: str,
    error: Exception, eval_only: bool, kind: str,
) -> None:  # fmt: skip
    _linear_raises(monkeypatch, error, eval_only)
    code, ev = train_in_process(make_spec(model={"name": model}, epochs=1), tmp_path / "run")
    err = _error(ev)
    assert err["kind"] == kind and str(error) in err["message"]
    if eval_only:
        assert err["message"].startswith("model mymodels:build failed in its first evaluation")
    assert code == (exitcodes.OUT_OF_MEMORY if kind == "out_of_memory" else exitcodes.FAILED)


def test_warm_start_from_another_jobs_weights(tmp_path: Path) -> None:
    first = make_spec(model={"name": "mlp", "hidden": [32]}, epochs=2)
    assert train_in_process(first, tmp_path / "a")[0] == exitcodes.OK
    weights = tmp_path / "a" / "model.safetensors"

    from torchyard.trainer.data import load_dataset
    from torchyard.trainer.distributed import Dist
    from torchyard.trainer.loop import build_net

    spec = parse_spec(make_spec(model={"name": "mlp", "hidden": [32]}, seed=7))
    ds = load_dataset(spec.data, tmp_path, spec.seed)
    d = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    net, _ = build_net(spec, ds, d, False, init=weights)
    want = load_file(str(weights))
    assert all(torch.equal(v, want[k]) for k, v in net.state_dict().items())
    # and a whole run from it starts better than a fresh one: its first loss is lower
    code, warm = train_in_process(make_spec(epochs=1, log_every_steps=1), tmp_path / "b",
                                  init=weights)  # fmt: skip
    _, cold = train_in_process(make_spec(epochs=1, log_every_steps=1), tmp_path / "c")
    first_loss = [
        next(e["value"] for e in ev.of_type("metric") if e["name"] == "train/loss")
        for ev in (warm, cold)
    ]
    assert code == exitcodes.OK and first_loss[0] < first_loss[1] * 0.5


def test_warm_start_with_wrong_shapes_names_the_tensors(tmp_path: Path) -> None:
    assert train_in_process(make_spec(epochs=1), tmp_path / "a")[0] == exitcodes.OK
    spec = make_spec(model={"name": "mlp", "hidden": [48]}, epochs=1)
    code, ev = train_in_process(spec, tmp_path / "b", init=tmp_path / "a" / "model.safetensors")
    err = _error(ev)
    assert (code, err["kind"]) == (exitcodes.FAILED, "init")
    assert "1.weight: [32, 64] in the checkpoint, [48, 64] in this model" in err["message"]
    assert "3.weight" in err["message"]


def test_examples_custom_model_and_data_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's examples: their factories build what their specs say."""
    import yaml

    for name in ("custom_model", "custom_data"):
        d = tmp_path / name
        shutil.copytree(REPO / "examples" / name, d)
        monkeypatch.syspath_prepend(str(d))
        spec = parse_spec(yaml.safe_load((d / "spec.yaml").read_text()))
        assert spec.runs_code
    for mod in ("model", "data"):
        sys.modules.pop(mod, None)
    spec = yaml.safe_load((REPO / "examples/custom_model/spec.yaml").read_text())
    spec.update(epochs=1, max_steps=3)
    code, ev = train_in_process(spec, tmp_path / "run1")
    assert code == exitcodes.OK, ev.of_type("error")
    spec = yaml.safe_load((REPO / "examples/custom_data/spec.yaml").read_text())
    spec.update(epochs=1, max_steps=3)
    code, ev = train_in_process(spec, tmp_path / "run2")
    assert code == exitcodes.OK, ev.of_type("error")
    assert ev.of_type("started")[0]["train_samples"] == 1348
