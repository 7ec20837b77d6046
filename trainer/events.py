"""Where the trainer's events go: JSON lines in `<run dir>/events.jsonl` on rank 0; on
every other rank k only its `error` and `stopped` events, in `<run dir>/events.rank<k>.jsonl`
(each rank's worker reads its own, so a rank that fails alone is seen with its real cause);
a list in tests.

Every event is one JSON object with `type` and `time` (Unix seconds). The types and
their fields are the contract with the worker: contracts/eventmodel.py declares them, and
every event is checked against it before it is written (an undeclared field or a value of
the wrong type is a ValueError here, not a line the worker would skip).

Every event also has `attempt` (the job's attempt number, from TORCHYARD_ATTEMPT, which the
worker sets) so that a supervisor can tell its own trainer's lines from an earlier attempt's
in the shared file. A trainer run by hand (variable unset) writes no `attempt` field at all,
rather than null. `started`, `finished`, `stopped` and `error` also carry `pid`, the process
id of the rank that wrote them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from torchyard.contracts.eventfiles import EVENTS_FILE, RANK_EVENTS, rank_events_file
from torchyard.contracts.eventmodel import EVENT_TYPES, build_event

__all__ = ["EVENTS_FILE", "rank_events_file"]
ATTEMPT_ENV = "TORCHYARD_ATTEMPT"
# The events that say which process ran, so the worker can match them to what it spawned.
PID_EVENTS = frozenset(t for t, model in EVENT_TYPES.items() if "pid" in model.model_fields)
_MAX_ATTEMPT = 2**31 - 1  # the store's attempt column is a 32-bit integer


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


def attempt_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The attempt number in TORCHYARD_ATTEMPT: None when unset; ValueError naming the
    variable when it is anything but a positive integer in plain decimal."""
    raw = (os.environ if environ is None else environ).get(ATTEMPT_ENV)
    if raw is None:
        return None
    # fullmatch on [0-9]: no sign, spaces, newline or non-ASCII digits that int() would take.
    if re.fullmatch(r"[1-9][0-9]{0,9}", raw) is None or int(raw) > _MAX_ATTEMPT:
        raise ValueError(
            f"{ATTEMPT_ENV}={raw!r}: must be the attempt number, an integer from 1 to "
            f"{_MAX_ATTEMPT} (or unset when the trainer is run by hand)"
        )
    return int(raw)


def make_event(type: str, fields: dict[str, Any], attempt: int | None) -> dict[str, Any]:
    """One event as written: type, time, the fields, then attempt and pid where they apply;
    checked against contracts/eventmodel.py (ValueError naming a bad type or field)."""
    event = {"type": type, "time": time.time(), **fields}
    if attempt is not None:
        event["attempt"] = attempt
    if type in PID_EVENTS:
        event["pid"] = os.getpid()
    return build_event(_clean(event))


class JsonlEvents:
    """Appends one flushed line per event; attempts of a job append to the same file."""

    def __init__(self, path: Path, attempt: int | None = None):
        self.path, self.attempt = path, attempt
        self._f = path.open("a", encoding="utf-8")

    def emit(self, type: str, **fields: Any) -> None:
        event = make_event(type, fields, self.attempt)
        self._f.write(json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        # A line a full disk refused is still in the buffer: closing must not turn the
        # trainer's exit code into a traceback (the file is closed either way).
        with contextlib.suppress(OSError):
            self._f.close()


class RankEvents(JsonlEvents):
    """The sink of every rank but 0: only what its own worker must know to classify the
    rank's end (rank 0 reports metrics and checkpoints for all)."""

    def emit(self, type: str, **fields: Any) -> None:
        if type in RANK_EVENTS:
            super().emit(type, **fields)


class MemoryEvents:
    """Keeps events in a list (tests, embedding the trainer in a notebook)."""

    def __init__(self, attempt: int | None = None) -> None:
        self.attempt = attempt
        self.events: list[dict[str, Any]] = []

    def emit(self, type: str, **fields: Any) -> None:
        self.events.append(make_event(type, fields, self.attempt))

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
