"""The stop request a signal handler leaves for the training loop (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopFlag:
    """Set from a signal handler; the loop checkpoints and stops at the next step boundary
    all ranks agree on."""

    signal: str | None = None
