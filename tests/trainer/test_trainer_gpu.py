"""GPU-only paths: fp16 with GradScaler, bf16 by `auto`, the DataLoader path with pinned
memory and non_blocking copies, data held on the GPU, and NCCL across two GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_testlib import (
    REPO,
    free_port,
    load_weights,
    make_spec,
    run_trainer,
    train_in_process,
    trainer_env,
    write_spec,
)

from trainer import exitcodes
from trainer.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fp16_uses_a_grad_scaler_and_learns(tmp_path: Path) -> None:
    spec = make_spec(model={"name": "lenet"}, precision="fp16", epochs=3,
                     optimizer={"name": "adam", "lr": 0.01})  # fmt: skip
    code, ev = train_in_process(spec, tmp_path, device="cuda")
    assert code == exitcodes.OK
    assert ev.events[0]["precision"] == "fp16" and ev.events[0]["device"].startswith("cuda")
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    assert ckpt["scaler"]["scale"] > 0
    assert ev.of_type("finished")[-1]["metrics"]["val/accuracy"] > 0.8


def test_auto_precision_on_cuda(tmp_path: Path) -> None:
    code, ev = train_in_process(make_spec(epochs=1), tmp_path, device="cuda")
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert code == 0 and ev.events[0]["precision"] == expected


def test_data_lives_on_the_gpu_on_the_device_path() -> None:
    from trainer.data import Batches, load_dataset
    from trainer.spec import DataSpec

    ds = load_dataset(DataSpec(name="digits"), Path("."), 0)
    b = Batches(ds, torch.device("cuda"), 64, 0, 1, 0, "device", 0, 256)
    x, y = next(b.train_epoch(0))
    assert b.mode == "device" and x.is_cuda and y.is_cuda and x.dtype == torch.float32


def test_dataloader_path_pins_memory_and_trains(tmp_path: Path) -> None:
    from trainer.data import Batches, load_dataset
    from trainer.spec import DataSpec

    ds = load_dataset(DataSpec(name="digits"), Path("."), 0)
    b = Batches(ds, torch.device("cuda"), 64, 0, 1, 0, "dataloader", 2, 256)
    assert b.loader.pin_memory
    x, y = next(b.train_epoch(0))
    assert x.is_cuda and y.is_cuda
    spec = make_spec(data={"name": "digits", "loader": "dataloader", "num_workers": 2}, epochs=3)
    code, ev = train_in_process(spec, tmp_path, device="cuda")
    assert code == 0 and ev.events[0]["loader"] == "dataloader"
    assert ev.of_type("finished")[-1]["metrics"]["val/accuracy"] > 0.9


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL test needs 2 GPUs")
def test_nccl_two_processes_equal_one(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.json", make_spec(world_size=2, precision="fp32"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "trainer", "--spec", str(spec),
           "--run-dir", str(tmp_path / "two")]  # fmt: skip
    p = subprocess.run(
        cmd, env=trainer_env(), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-4000:]
    q = run_trainer(spec, tmp_path / "one", CUDA_VISIBLE_DEVICES="0")
    assert q.returncode == 0, q.stderr[-4000:]
    a, b = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    for k in a:  # TF32 matmuls on GPU: a looser tolerance than on CPU
        torch.testing.assert_close(a[k], b[k], rtol=1e-2, atol=1e-3)
