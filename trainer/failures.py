"""What kind of failure an exception is: the `kind` of the `error` event and the exit code.

The kinds decide what the scheduler does (worker/outcome.py): `data`, `out_of_memory`,
`nonfinite_loss` and `unsupported` (an op `deterministic: true` cannot run) are the job's
own and fail it at once, as do `user_code` (an exception raised by, or a wrong value
returned from, the user's model, data set or script: `UserCodeError`; or any exception
whose traceback passes through a frame of the user's code, such as a bundle model's
`forward` called by our training loop; or a bundle model's first training step or evaluation
batch failing without a hardware kind: trainer/usercode.py `first_pass`), `init` (the
spec's `init` weights do not fit the model), `spec` (it names a model this worker's
torchvision lacks) and `model_too_large` (over TORCHYARD_MAX_MODEL_PARAMS); `storage_full` is the worker's and
hands the job back (when the worker, looking at the file system itself, finds it full: user
code could claim it too); `peer_failed` means another rank died first (its worker reports the
real cause), and `internal` is retried.

Errors arrive wrapped: torch.compile re-raises an OOM as BackendCompilerFailed or
InductorError, NCCL reports one as a DistBackendError with CUDA's text in the message, and
`raise ... from` chains hide the original. So every test here walks the whole chain
(`__cause__`, `__context__`, and the compilers' `inner_exception`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from torchyard.contracts import exitcodes

# Messages that mean an allocation failed, whatever the exception's type.
OOM_MARKERS = (
    "out of memory",  # CUDA's OOM text, also inside NCCL and cuBLAS errors
    "can't allocate memory",  # the CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
)
# Messages from the collectives when the rank on the other end has gone.
PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
    "Timed out waiting",
)
# Messages of a fault in the device, its driver or its libraries: the machine's, whatever
# model was running (a device-side assert, an illegal address, a lost GPU).
DEVICE_MARKERS = ("CUDA error", "CUDA driver error", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL")
# torch.compile's own crashes (InductorError is one): a compiler bug, not the model's. A
# model's shape error under compile is a TorchRuntimeError instead.
COMPILER_FAILURES = ("BackendCompilerFailed", "InductorError")
FULL_BELOW_BYTES = 1 << 20
# torch.use_deterministic_algorithms(True) refuses ops without a deterministic kernel.
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"


def chain(e: BaseException) -> Iterator[BaseException]:
    """The exception and everything it wraps, each once."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        for inner in (x.__cause__, x.__context__, getattr(x, "inner_exception", None)):
            if isinstance(inner, BaseException):
                todo.append(inner)


# Where the user's code lives in this process: the job's code bundle, and the folder of each
# installed package a factory was imported from (trainer/usercode.py adds them).
_user_roots: set[Path] = set()


def add_user_root(folder: Path) -> None:
    _user_roots.add(folder.resolve())


def from_user_code(e: BaseException) -> bool:
    """Whether the exception (or one it wraps) was raised through a frame of the user's
    code: their `forward` multiplying the wrong shapes fails inside torch, below their
    frame, and is theirs all the same."""
    if not _user_roots:
        return False
    for x in chain(e):
        tb = x.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if not name.startswith("<") and _under_user_root(Path(name)):
                return True
            tb = tb.tb_next
    return False


def _under_user_root(path: Path) -> bool:
    try:
        p = path.resolve()
    except OSError:
        return False
    return any(p.is_relative_to(root) for root in _user_roots)


def is_oom(e: BaseException) -> bool:
    for x in chain(e):
        if isinstance(x, torch.OutOfMemoryError | MemoryError):
            return True
        if isinstance(x, RuntimeError) and any(m in str(x) for m in OOM_MARKERS):
            return True
    return False


def is_peer_failure(e: BaseException) -> bool:
    """A collective failed because another rank is gone (or silent past the timeout)."""
    for x in chain(e):
        if isinstance(x, torch.distributed.DistError):
            return True
        if isinstance(x, RuntimeError) and any(m in str(x) for m in PEER_MARKERS):
            return True
    return False


def is_device_fault(e: BaseException) -> bool:
    for x in chain(e):
        if isinstance(x, torch.AcceleratorError):
            return True
        if isinstance(x, RuntimeError) and any(m in str(x) for m in DEVICE_MARKERS):
            return True
    return False


def is_compiler_failure(e: BaseException) -> bool:
    # By name: importing torch._dynamo here would cost every trainer start a second.
    return any(type(x).__name__ in COMPILER_FAILURES for x in chain(e))


def storage_full(e: BaseException, run_dir: Path) -> bool:
    """The failure came from a full file system: ENOSPC/EDQUOT anywhere in the exception's
    chain, or (torch.save reports a failed write as a bare RuntimeError) any error while
    the run directory's file system has less than 1 MiB left."""
    for x in chain(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


class UserCodeError(Exception):
    """The user's code failed: an exception in their factory or script (chained as
    `__cause__`, its traceback printed to the job log) or a wrong return value."""


class SpecProblem(Exception):
    """The spec names something this worker does not have (a torchvision model that its
    torchvision does not list); the API cannot check it without torch."""


class InitError(Exception):
    """The spec's `init` weights cannot start this model (missing, mismatched tensors)."""


class ModelTooLarge(Exception):
    """The model has more parameters than the server allows (TORCHYARD_MAX_MODEL_PARAMS),
    found before it was allocated (trainer/modelguard.py)."""


def describe(e: BaseException) -> str:
    """The `error` event's message: our own error types say what happened in their text;
    any other exception needs its type's name too."""
    if isinstance(e, UserCodeError | InitError | SpecProblem | ModelTooLarge):
        return str(e)
    return f"{type(e).__name__}: {e}"


def classify(e: BaseException, run_dir: Path) -> tuple[str, int]:
    """(error kind, exit code) for an exception that ended training. OOM first: a rank that
    ran out of memory inside a collective is the cause, not a victim."""
    if is_oom(e):
        return "out_of_memory", exitcodes.OUT_OF_MEMORY
    if storage_full(e, run_dir):
        return "storage_full", exitcodes.STORAGE_FULL
    if isinstance(e, UserCodeError):
        return "user_code", exitcodes.FAILED
    if isinstance(e, InitError):
        return "init", exitcodes.FAILED
    if isinstance(e, SpecProblem):
        return "spec", exitcodes.FAILED
    if isinstance(e, ModelTooLarge):
        return "model_too_large", exitcodes.FAILED
    if is_peer_failure(e):
        return "peer_failed", exitcodes.FAILED
    if any(isinstance(x, RuntimeError) and NO_DETERMINISTIC_KERNEL in str(x) for x in chain(e)):
        return "unsupported", exitcodes.FAILED
    if from_user_code(e):
        return "user_code", exitcodes.FAILED
    return "internal", exitcodes.FAILED


def keeps_its_kind(e: BaseException, run_dir: Path) -> bool:
    """Whether a failure in a user's model is told by what it is, not whose model it was:
    classify names it already (OOM, a full disk, a lost peer, our own error types), or it
    is a fault of the device or of torch.compile, which stays `internal` and is retried."""
    if classify(e, run_dir)[0] != "internal":
        return True
    return is_device_fault(e) or is_compiler_failure(e)
