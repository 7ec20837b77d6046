"""Process topology: which device this rank drives, whether DDP is on, and the few
collectives the loop needs. Under torchrun the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) says it all; without it the process is rank 0 of 1.
A worker pins its GPU with CUDA_VISIBLE_DEVICES (a UUID, in PCI bus order: see
worker/identity.py), so `cuda:LOCAL_RANK` is counted among the visible devices only, and a
rank whose LOCAL_RANK has no visible device of its own is refused (two ranks on one GPU
would run, slowly and wrongly, or hang in NCCL).

Collectives get an explicit timeout (TORCHYARD_COLLECTIVE_TIMEOUT_S, default 600 s): a rank
whose peer died stops waiting and reports `peer_failed` instead of hanging until killed.

Every collective here moves tensors: the pickling `*_object*` collectives are never used
(a test scans for them), structured values travel as trainer/wire.py bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchyard.trainer import wire

# A sanity bound on what one rank may announce it sends (RNG states are ~10 KB).
MAX_GATHER_BYTES = 1 << 30
COLLECTIVE_TIMEOUT_ENV = "TORCHYARD_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
PRECISIONS = ("fp32", "fp16", "bf16")


class DeviceError(RuntimeError):
    """This rank cannot get a device of its own (a launch or pinning mistake)."""


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes events, checkpoints and logs."""
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        return self.world_size > 1


def setup() -> Dist:
    """Pick the device (CUDA if present, else CPU) and join the process group under torchrun:
    NCCL on CUDA, gloo on CPU."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = cuda_device(local, torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=collective_timeout_s()),
            **kwargs,
        )
    return Dist(rank=rank, local_rank=local, world_size=world, device=device)


def cuda_device(local_rank: int, visible: int) -> torch.device:
    """`cuda:LOCAL_RANK`, or DeviceError when this rank has no visible GPU of its own (the
    old `local % count` put two ranks on cuda:0 without a word)."""
    if not 0 <= local_rank < visible:
        raise DeviceError(
            f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but this process sees "
            f"{visible} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "give each rank its own GPU (torchrun --nproc-per-node at most the visible GPUs)"
        )
    return torch.device("cuda", local_rank)


def collective_timeout_s(environ: dict[str, str] | None = None) -> float:
    raw = (os.environ if environ is None else environ).get(COLLECTIVE_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DeviceError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return value


def teardown(d: Dist) -> None:
    if d.ddp and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (a no-op for one process)."""
    if d.ddp:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(d: Dist) -> None:
    if d.ddp:
        dist.barrier()


def all_gather_bytes(d: Dist, payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order, through tensor collectives only: the lengths
    as int64, then the bytes as uint8 padded to the longest (all_gather needs equal sizes)."""
    if not d.ddp:
        return [payload]
    # NCCL moves CUDA tensors only; gloo moves CPU ones: d.device is right for both.
    size = torch.tensor([len(payload)], dtype=torch.int64, device=d.device)
    sizes = [torch.empty_like(size) for _ in range(d.world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s) for s in torch.cat(sizes).tolist()]
    longest = max(lengths)
    if not 0 <= min(lengths) <= longest <= MAX_GATHER_BYTES:
        raise RuntimeError(f"all_gather_bytes: bad lengths {lengths} from the ranks")
    if longest == 0:
        return [b""] * d.world_size
    buf = torch.zeros(longest, dtype=torch.uint8, device=d.device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(d.world_size)]
    dist.all_gather(bufs, buf)
    return [b[:n].cpu().numpy().tobytes() for b, n in zip(bufs, lengths, strict=True)]


def gather_to_main(d: Dist, obj: Any) -> list[Any]:
    """Every rank's `obj` (JSON types and tensors: trainer/wire.py), in rank order (rank 0
    uses the result; others get it too). Never pickled: see trainer/wire.py."""
    if not d.ddp:
        return [obj]
    return [wire.decode(b) for b in all_gather_bytes(d, wire.encode(obj))]


def local_precision(device: torch.device) -> str:
    """What `auto` means on this device: bf16 where the GPU does it natively (Ampere and
    later), fp16 with a GradScaler on older GPUs (V100, T4: their bf16 is emulated, slower
    than fp32), fp32 on CPU."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native else "fp16"
    return "fp32"


def resolve_precision(
    requested: str, d: Dist, local: Callable[[torch.device], str] = local_precision
) -> str:
    """The spec's `precision` as every rank will run it: rank 0 decides (`auto` by its own
    device) and broadcasts, so a job never mixes a GradScaler rank with an unscaled one on
    a pool of unlike GPUs. A collective: every rank calls it."""
    choice = requested if requested != "auto" else local(d.device)
    if not d.ddp:
        return choice
    code = torch.tensor([PRECISIONS.index(choice)], dtype=torch.int64, device=d.device)
    dist.broadcast(code, src=0)
    return PRECISIONS[int(code.item())]


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
