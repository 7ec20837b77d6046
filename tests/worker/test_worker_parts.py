"""Small parts of the worker, in-process: ids and slot locks, the trainer's argv and
environment. The scheduler process's reconciler is tested in
tests/scheduler/test_scheduler_process.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchyard.worker.identity import SlotTaken, claim_id
from torchyard.worker.proc import Launch, trainer_argv, trainer_env


def test_worker_ids_are_stable_and_exclusive(tmp_path: Path) -> None:
    a, lock_a = claim_id(tmp_path, name=None, gpu=None)
    b, lock_b = claim_id(tmp_path, name=None, gpu=None)
    assert a.endswith("-cpu0") and b.endswith("-cpu1")
    g, lock_g = claim_id(tmp_path, name=None, gpu=3)
    assert g.endswith("-gpu3")
    with pytest.raises(SlotTaken):
        claim_id(tmp_path, name=None, gpu=3)  # one worker per GPU per host
    lock_a.close()  # the process holding cpu0 is gone: a new one takes its id back
    again, _ = claim_id(tmp_path, name=None, gpu=None)
    assert again == a
    with pytest.raises(ValueError):
        claim_id(tmp_path, name="../../etc", gpu=None)
    lock_b.close()
    lock_g.close()


def test_trainer_argv_is_a_list_and_ddp_uses_torchrun(tmp_path: Path) -> None:
    one = trainer_argv(
        Launch(spec_path=tmp_path / "s.json", run_dir=tmp_path, resume=tmp_path / "c.pt")
    )
    assert one[1:3] == ["-m", "torchyard.trainer"] and one[-2:] == [
        "--resume",
        str(tmp_path / "c.pt"),
    ]
    ddp = trainer_argv(
        Launch(
            spec_path=tmp_path / "s.json",
            run_dir=tmp_path,
            world_size=2,
            rank=1,
            master_addr="10.0.0.5",
            master_port=29511,
        )
    )
    assert ddp[1:3] == ["-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=1",
        "--master-addr=10.0.0.5",
        "--master-port=29511",
    ):
        assert flag in ddp
    assert ddp[ddp.index("-m", 3) + 1] == "torchyard.trainer"


def test_trainer_env_pins_the_device_and_drops_secrets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://u:secret@db/x")
    cpu = trainer_env(data_root=tmp_path, cuda_visible="")
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""  # a CPU slot sees no GPU
    assert cpu["TORCHYARD_DATA_ROOT"] == str(tmp_path)
    assert cpu["TORCHYARD_DIE_WITH_PARENT"] == "1" and cpu["PYTHONUNBUFFERED"] == "1"
    assert "TORCHYARD_DATABASE_URL" not in cpu
    assert trainer_env(data_root=tmp_path, cuda_visible="2")["CUDA_VISIBLE_DEVICES"] == "2"
