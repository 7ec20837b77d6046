"""Where the trainer's events go: JSON lines in `<run dir>/events.jsonl` on rank 0,
nowhere on the other ranks, a list in tests.

Every event is one JSON object with `type` and `time` (Unix seconds). The types and
their fields are the contract with the worker (see DESIGN.md):

    started     world_size, device, precision, versions, resumed_from, step, total_steps, attempt?
    metric      step, epoch, name, value       (train/loss, train/lr, train/samples_per_s,
                                                val/loss, val/accuracy)
    checkpoint  step, epoch, path, bytes, sha256, kind ("resume" | "weights"), pruned
    progress    step, total_steps, epoch, samples_per_s, eta_s
    finished    step, epoch, metrics
    stopped     signal, step, checkpoint
    error       kind ("nonfinite_loss" | "out_of_memory" | "data" | "internal"), message, step
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

EVENTS_FILE = "events.jsonl"


class EventSink(Protocol):
    def emit(self, type: str, **fields: Any) -> None: ...

    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: a non-finite number is written as null rather than breaking the line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class JsonlEvents:
    """Appends one flushed line per event; attempts of a job append to the same file."""

    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("a", encoding="utf-8")

    def emit(self, type: str, **fields: Any) -> None:
        event = _clean({"type": type, "time": time.time(), **fields})
        self._f.write(json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class NullEvents:
    """The sink of every rank but 0."""

    def emit(self, type: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryEvents:
    """Keeps events in a list (tests, embedding the trainer in a notebook)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, type: str, **fields: Any) -> None:
        self.events.append(_clean({"type": type, "time": time.time(), **fields}))

    def close(self) -> None:
        pass

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type]


def read_events(path: Path) -> list[dict[str, Any]]:
    """All complete lines of an events file (a torn last line is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
