"""Training runs in this process (CPU): accuracy, models, precisions, schedules, the
events contract, and how failures end (error event + exit code)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_testlib import make_spec, train_in_process

from torchyard.contracts import exitcodes
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.checkpoint import list_checkpoints, load_checkpoint
from torchyard.trainer.optim import lr_schedule

EVENT_FIELDS = {
    "started": {
        "world_size",
        "device",
        "precision",
        "versions",
        "resumed_from",
        "step",
        "total_steps",
    },
    "metric": {"step", "epoch", "name", "value"},
    "checkpoint": {"step", "epoch", "path", "bytes", "sha256", "kind"},
    "progress": {"step", "total_steps", "epoch", "samples_per_s", "eta_s"},
    "finished": {"step", "epoch", "metrics"},
    "error": {"kind", "message", "step"},
}
METRIC_NAMES = {"train/loss", "train/lr", "train/samples_per_s", "val/loss", "val/accuracy"}


def test_digits_mlp_reaches_95_percent_and_honours_the_events_contract(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "mlp", "hidden": [128]}, epochs=8, batch_size=32,
                     checkpoint={"every_epochs": 2, "every_steps": 25, "keep_last": 2})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.OK
    finished = ev.of_type("finished")[-1]
    assert finished["metrics"]["val/accuracy"] >= 0.95
    for e in ev.events:
        assert isinstance(e["time"], float)
        assert EVENT_FIELDS.get(e["type"], set()) <= e.keys(), e
    assert {e["name"] for e in ev.of_type("metric")} == METRIC_NAMES
    started = ev.events[0]
    assert started["type"] == "started" and started["versions"]["torch"] == torch.__version__
    spe = started["steps_per_epoch"]
    assert started["total_steps"] == 8 * spe == finished["step"]
    # step is the global optimizer step: monotone, and checkpoints land where the spec says
    steps = [e["step"] for e in ev.events if "step" in e]
    assert steps == sorted(steps)
    resume = [e for e in ev.of_type("checkpoint") if e["kind"] == "resume"]
    expected = sorted({s for s in range(25, 8 * spe + 1, 25)} | {2 * spe * k for k in range(1, 5)})
    assert [e["step"] for e in resume] == expected
    # every announced file that still exists has the announced bytes and sha256
    for e in ev.of_type("checkpoint"):
        f = tmp_path / e["path"]
        if e["kind"] == "weights" or e["step"] in [s for s, _ in list_checkpoints(tmp_path)]:
            data = f.read_bytes()
            assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    # keep_last=2: only the two newest remain, pruned ones were announced as such
    assert [s for s, _ in list_checkpoints(tmp_path)] == expected[-2:]
    pruned = {p for e in resume for p in e["pruned"]}
    assert pruned == {f"checkpoints/step-{s:08d}.pt" for s in expected[:-2]}
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))
    # the final weights load without pickle and match the last resume checkpoint
    weights = load_file(str(tmp_path / "model.safetensors"))
    last = load_checkpoint(list_checkpoints(tmp_path)[-1][1])
    assert last["step"] == finished["step"]
    assert all(torch.equal(weights[k], v) for k, v in last["model"].items())


def test_lenet_trains_on_cifar_format_data(tmp_path: Path, cifar_root: Path) -> None:
    spec = make_spec(model={"name": "lenet"}, data={"name": "cifar10"}, epochs=3,
                     optimizer={"name": "adam", "lr": 0.003}, batch_size=50)  # fmt: skip
    code, ev = train_in_process(spec, tmp_path, data_root=cifar_root)
    assert code == exitcodes.OK
    started, finished = ev.events[0], ev.of_type("finished")[-1]
    assert started["train_samples"] == 1000 and started["val_samples"] == 200
    losses = [e["value"] for e in ev.of_type("metric") if e["name"] == "train/loss"]
    assert losses[-1] < losses[0] * 0.7
    assert finished["metrics"]["val/accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_resnet18_small_image_stem_runs(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "resnet18"}, max_steps=2, batch_size=8, epochs=1,
                     data={"name": "synthetic", "shape": [3, 8, 8], "size": 40, "num_classes": 3})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.OK
    w = load_file(str(tmp_path / "model.safetensors"))
    assert w["conv1.weight"].shape == (64, 3, 3, 3) and w["fc.weight"].shape == (3, 512)
    assert ev.of_type("finished")[-1]["step"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_cpu(tmp_path: Path, precision: str) -> None:
    spec = make_spec(model={"name": "lenet"}, precision=precision, epochs=2, grad_clip=1.0,
                     channels_last=True, optimizer={"name": "adam", "lr": 0.01})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.OK
    assert ev.events[0]["precision"] == precision
    ckpt = load_checkpoint(list_checkpoints(tmp_path)[-1][1])
    assert (ckpt["scaler"] is not None) == (precision == "fp16")  # GradScaler only for fp16
    assert ev.of_type("finished")[-1]["metrics"]["val/accuracy"] > 0.7


def test_auto_precision_is_fp32_on_cpu(tmp_path: Path) -> None:
    code, ev = train_in_process(make_spec(epochs=1), tmp_path)
    assert code == 0 and ev.events[0]["precision"] == "fp32" and ev.events[0]["device"] == "cpu"


def test_samples_per_s_leaves_evaluation_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow validation pass must not read as slow training: every window's
    train/samples_per_s, and the final one, count training time only. The loop's clock
    jumps 1,000 s inside each validation pass, so the check does not hang on how fast this
    machine trains at the moment (a real sleep of 0.5 s did, under CI's load)."""
    import time
    import types

    from torchyard.trainer import loop
    from torchyard.trainer.data import Batches

    jumped = [0.0]
    monkeypatch.setattr(
        loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jumped[0])
    )
    real_val = Batches.val_batches

    def val_batches(self):  # type: ignore[no-untyped-def]
        jumped[0] += 1000.0
        yield from real_val(self)

    monkeypatch.setattr(Batches, "val_batches", val_batches)
    spec = make_spec(epochs=3, batch_size=32, log_every_steps=10)
    code, ev = train_in_process(spec, tmp_path / "run")
    assert code == exitcodes.OK and jumped[0] >= 3000.0
    rates = [e["value"] for e in ev.of_type("metric") if e["name"] == "train/samples_per_s"]
    assert len(rates) >= 6
    # A window holding an evaluation would read <= 320 samples / 1,000 s; any real training
    # rate of this MLP, however loaded the machine, is far above 10 samples/s.
    assert min(rates) > 10, rates
    final = ev.of_type("finished")[0]["metrics"]["train/samples_per_s"]
    assert final > 10, final


def test_max_steps_stops_mid_epoch_and_saves(tmp_path: Path) -> None:
    code, ev = train_in_process(make_spec(max_steps=7, epochs=5), tmp_path)
    assert code == 0 and ev.of_type("finished")[-1]["step"] == 7
    ckpt = load_checkpoint(tmp_path / "checkpoints/step-00000007.pt")
    assert (ckpt["epoch"], ckpt["batch_in_epoch"]) == (0, 7)


def test_nonfinite_loss_is_an_error_with_its_step(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "mlp", "hidden": [512, 512]}, epochs=20, log_every_steps=50,
                     optimizer={"name": "sgd", "lr": 10.0, "momentum": 0.99})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.NONFINITE_LOSS
    err = ev.events[-1]
    assert err["type"] == "error" and err["kind"] == "nonfinite_loss"
    assert err["pid"] == os.getpid()  # the sink stamps the process on lifecycle events
    # the reported step is the first bad one: losses logged before it were all finite
    assert err["step"] >= 1 and f"step {err['step']}" in err["message"]
    assert all(e["step"] < err["step"] for e in ev.of_type("metric"))
    assert not ev.of_type("finished")


def test_out_of_memory_is_reported(tmp_path: Path) -> None:
    # 10M samples of 16M bytes on the device path: the allocation fails at once.
    spec = make_spec(data={"name": "synthetic", "shape": [16, 1024, 1024], "size": 10_000_000,
                           "loader": "device"})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path)
    assert code == exitcodes.OUT_OF_MEMORY
    assert ev.events[-1]["type"] == "error" and ev.events[-1]["kind"] == "out_of_memory"


def test_missing_data_is_a_data_error(tmp_path: Path) -> None:
    code, ev = train_in_process(make_spec(data={"name": "mnist"}), tmp_path, data_root=tmp_path)
    assert code == exitcodes.FAILED
    err = ev.events[-1]
    assert err["kind"] == "data" and "train-images-idx3-ubyte" in err["message"]


def test_auto_loader_falls_back_to_a_dataloader_when_the_set_does_not_fit(tmp_path: Path) -> None:
    import torchyard.trainer.data as data

    spec = make_spec(epochs=1, data={"name": "digits", "num_workers": 0})
    orig = data.memory_budget
    data.memory_budget = lambda device: 1000  # type: ignore[assignment]
    try:
        code, ev = train_in_process(spec, tmp_path)
    finally:
        data.memory_budget = orig
    assert code == 0 and ev.events[0]["loader"] == "dataloader"


@pytest.mark.parametrize("name", ["constant", "cosine", "onecycle"])
def test_schedules(name: str) -> None:
    spec = parse_spec(make_spec(optimizer={"name": "sgd", "lr": 0.1},
                                schedule={"name": name, "warmup_steps": 10}))  # fmt: skip
    lr = lr_schedule(spec, total_steps=100)
    assert lr(0) < lr(5) < lr(9) <= 0.1 + 1e-12  # warm-up rises to the peak
    assert lr(10) == pytest.approx(0.1)
    if name == "constant":
        assert lr(99) == 0.1
    else:
        assert lr(99) < 0.01 and lr(50) < 0.1
