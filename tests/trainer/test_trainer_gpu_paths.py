"""The trainer's GPU code paths, run on CPU through the same code (gloo, fake devices where
a path only decides): precision chosen natively and broadcast from rank 0, a rank without
a GPU of its own refused, fused optimizers on CUDA, DDP compiled as a whole, channels_last
converted per batch, OOMs found through their wrappers, and a failure on rank 1 reported
by rank 1 itself through the real torchrun launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_testlib import (
    REPO,
    make_spec,
    start_gang,
    train_in_process,
    trainer_env,
    wait_all,
    write_spec,
)

from torchyard.contracts import exitcodes
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.distributed import DeviceError, Dist, cuda_device, local_precision
from torchyard.trainer.failures import classify, is_oom, is_peer_failure
from torchyard.trainer.loop import wrap_model
from torchyard.trainer.optim import build_optimizer


def test_auto_precision_ignores_emulated_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch counts emulated bf16 (V100, T4) unless asked not to: those GPUs get fp16.
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    assert local_precision(torch.device("cuda", 0)) == "fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert local_precision(torch.device("cuda", 0)) == "bf16"
    assert local_precision(torch.device("cpu")) == "fp32"


PRECISION_PROBE = """
import torch, trainer.distributed as td
d = td.setup()
mine = "bf16" if d.rank == 1 else "fp16"   # rank 1's GPU would say otherwise
print(td.resolve_precision("auto", d, local=lambda dev: mine), flush=True)
td.teardown(d)
"""


def test_precision_is_decided_by_rank_0_and_broadcast(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PRECISION_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script)]  # fmt: skip
    # gloo on CPU, also on a GPU machine (two ranks on one GPU would rightly be refused).
    env = trainer_env(CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    # Both ranks share one stdout: their lines may interleave, so count the words.
    assert re.findall(r"fp16|bf16|fp32", p.stdout) == ["fp16", "fp16"]


def test_a_rank_without_a_gpu_of_its_own_is_refused() -> None:
    assert cuda_device(0, 1) == torch.device("cuda", 0)
    assert cuda_device(1, 2) == torch.device("cuda", 1)
    # `local % count` used to put this rank on cuda:0 beside rank 0.
    with pytest.raises(DeviceError, match="LOCAL_RANK 1 needs GPU 1, but this process sees 1"):
        cuda_device(1, 1)


def test_cuda_optimizers_are_fused_so_fp16_steps_never_sync() -> None:
    net = nn.Linear(4, 2)
    for name in ("sgd", "adam", "adamw"):
        spec = parse_spec(make_spec(optimizer={"name": name, "lr": 0.1}))
        cuda = build_optimizer(spec, net, torch.device("cuda"))
        assert cuda.defaults["fused"] is True and not cuda.defaults["foreach"], name
        assert getattr(cuda, "_step_supports_amp_scaling", False), name  # GradScaler: no .item()
        cpu = build_optimizer(spec, net, torch.device("cpu"))
        assert not cpu.defaults["fused"] and cpu.defaults["foreach"] is False, name


def test_ddp_is_compiled_as_a_whole_and_evaluation_uses_the_plain_net(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        d = Dist(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
        train, fwd = wrap_model(net, d, compile=True)
        # torch.compile(DDP(net)): dynamo splits at DDP's buckets, all-reduce overlaps backward.
        assert isinstance(getattr(train, "_orig_mod", None), DistributedDataParallel)
        assert getattr(fwd, "_orig_mod", None) is net
        plain, fwd2 = wrap_model(net, d, compile=False)
        assert isinstance(plain, DistributedDataParallel) and fwd2 is net
        assert list(net.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    finally:
        dist.destroy_process_group()
    one = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    t, f = wrap_model(net, one, compile=True)
    assert t is f and getattr(t, "_orig_mod", None) is net  # one compile, no DDP


def test_channels_last_is_applied_per_batch_not_to_the_resident_set(cifar_root: Path) -> None:
    from torchyard.contracts.spec import DataSpec
    from torchyard.trainer.data import Batches, load_dataset

    ds = load_dataset(DataSpec(name="cifar10"), cifar_root, 0)
    b = Batches(ds, device=torch.device("cpu"), per_rank_batch=32, loader="device",
                eval_batch=256, channels_last=True)  # fmt: skip
    resident, _ = b._train
    assert resident.is_contiguous()  # NCHW: index_select would return NCHW anyway
    x, _ = next(b.train_epoch(0))
    assert x.is_contiguous(memory_format=torch.channels_last) and x.shape == (32, 3, 32, 32)
    vx, _ = next(b.val_batches())
    assert vx.is_contiguous(memory_format=torch.channels_last)


def _wrapped(inner: BaseException, outer: type[BaseException]) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer("while compiling") from e
    except BaseException as e:
        return e


def test_ooms_are_found_through_compiler_and_nccl_wrappers(tmp_path: Path) -> None:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    cuda_oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    compiled = BackendCompilerFailed(lambda *a: None, cuda_oom, None)
    assert is_oom(compiled)
    assert classify(InductorError(cuda_oom, None), tmp_path) == (
        "out_of_memory",
        exitcodes.OUT_OF_MEMORY,
    )
    nccl = torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:2035, unhandled cuda error, NCCL version 2.27.5\n"
        "Last error:\nCuda failure 'out of memory'"
    )
    assert classify(nccl, tmp_path)[0] == "out_of_memory"
    assert classify(_wrapped(MemoryError(), RuntimeError), tmp_path)[0] == "out_of_memory"
    # A peer's death is not this rank's fault, and an ordinary bug is internal.
    gloo = RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:412")
    assert is_peer_failure(gloo) and classify(gloo, tmp_path)[0] == "peer_failed"
    assert classify(ValueError("shapes do not match"), tmp_path) == ("internal", exitcodes.FAILED)
    # `deterministic: true` with an op that has no deterministic kernel: not worth a retry.
    refused = RuntimeError(
        "adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but "
        "you set 'torch.use_deterministic_algorithms(True)'"
    )
    assert classify(refused, tmp_path)[0] == "unsupported"


def test_deterministic_spec_turns_on_deterministic_kernels(tmp_path: Path) -> None:
    try:
        code, ev = train_in_process(make_spec(deterministic=True, epochs=1), tmp_path)
        assert code == 0 and ev.events[0]["deterministic"] is True
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    code, ev = train_in_process(make_spec(epochs=1), tmp_path / "b")
    assert code == 0 and ev.events[0]["deterministic"] is False
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_rank_that_fails_alone_reports_its_own_cause(
    tmp_path: Path, mnist_root: Path, failing_rank: int
) -> None:
    """Two torchruns as the workers start them (gloo); one rank's host lacks the data. That
    rank reports `data` in its own events file; the other stops waiting at once and says
    `peer_failed`, instead of an exit 1 that looked retryable on every rank."""
    spec = write_spec(tmp_path / "spec.json", make_spec(data={"name": "mnist"}, world_size=2))
    empty = tmp_path / "empty"
    empty.mkdir()
    roots = [mnist_root, mnist_root]
    roots[failing_rank] = empty
    procs = start_gang(spec, tmp_path / "run", data_roots=roots, COLLECTIVE_TIMEOUT_S="60",
                       OMP_NUM_THREADS="1")  # fmt: skip
    results = wait_all(procs, timeout=120)
    assert all(code != 0 for code, _ in results), results
    run = tmp_path / "run"

    def errors(name: str) -> list[dict]:
        lines = (run / name).read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["type"] == "error"]

    files = {0: "events.jsonl", 1: "events.rank1.jsonl"}
    (mine,) = errors(files[failing_rank])
    assert mine["kind"] == "data" and "mnist" in mine["message"].lower()
    assert mine["rank"] == failing_rank and mine["attempt"] == 1
    (other,) = errors(files[1 - failing_rank])
    assert other["kind"] == "peer_failed", other
