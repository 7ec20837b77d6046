"""What the process runs on, for the `started` event and the head of the job log."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
from typing import Any

import torch


def _version(dist: str) -> str | None:
    # From the installed metadata: importing torchvision just for its version costs a second.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()) if torch.cuda.is_available() else None,
    }


def environment(device: torch.device, rank: int, world_size: int) -> dict[str, Any]:
    env = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "rank": rank,
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        **versions(),
    }
    return env
