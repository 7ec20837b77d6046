"""The trainer→worker event format: one pydantic model per event `type`, and the
discriminated union that both sides go through (torch-free: the worker imports it; it
imports pydantic and the standard library only, like contracts/spec.py).

The trainer builds every line with `build_event` (trainer/events.py writes it to
`events.jsonl`); the worker parses every line with `parse_event_line` (worker/events.py).
The JSON on disk is unchanged: the keys the trainer passed, in its order, and nothing
else, so older files still read. Every field but `type` is optional: the worker takes what
a line has (a line of an older trainer, a test's hand-made event) and judges missing values
itself; a field of the wrong JSON type makes the whole line bad (logged and skipped).
Fields no model names are kept when reading (a newer trainer) but refused when building.

    started     world_size, device, device_name, precision, sync_batchnorm, deterministic,
                versions, resumed_from, step, epoch, total_steps, steps_per_epoch, loader,
                train_samples, val_samples, parameters
    metric      step, epoch, name, value (null: not finite)
    checkpoint  step, epoch, path, bytes, sha256, kind ("resume" | "weights"), pruned
    artifact    step, name, path ("artifacts/<name>"), bytes, sha256 (`job.save_artifact`)
    progress    step, total_steps, epoch, samples_per_s, eta_s
    finished    step, epoch, metrics
    stopped     signal, step, checkpoint
    rung        step, index, name, value (a sweep trial waits at a rung: contracts/rungs.py)
    error       kind, message, step, rank

Every event may carry `time` (Unix seconds; the trainer always writes it), `attempt` (the
job's attempt number; absent when the trainer runs by hand) and `pid` (`started`,
`finished`, `stopped`, `error`).

A line that parses is not yet a line the worker takes: `event_problem` holds the rules that
keep what user code writes within what the store can hold (the worker sets a line aside,
counted and reported, when it names a problem): integers in range (a step is a
non-negative 63-bit integer), numbers finite (but a metric's value, where a non-finite one
means "not recorded"), no NUL or control characters in metric names, a metric name at most
`EventLimits.metric_name_chars` long, checkpoint paths relative and inside the run
directory with a sha256 of 64 hex digits, an artifact's name `ARTIFACT_NAME` and its path
exactly `artifacts/<name>`, and error kinds from `ERROR_KINDS`. The line's
size and the number of distinct metric names of a job are the worker's to count
(`EventLimits`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "ARTIFACT_DIR",
    "ARTIFACT_NAME",
    "ERROR_KINDS",
    "EVENT_TYPES",
    "HOST_FAULT_KINDS",
    "Event",
    "EventBase",
    "EventLimits",
    "ValidationError",
    "artifact_name_problem",
    "build_event",
    "event_dict",
    "event_problem",
    "parse_event",
    "parse_event_line",
]

# int | float, not float: a value is written back exactly as the trainer gave it (1, not 1.0).
Number = int | float


class EventBase(BaseModel):
    # strict: no "5" for 5; extra="allow": a newer trainer's fields survive an older worker.
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    time: Number | None = None
    attempt: int | None = None
    step: int | None = None


class _PidEvent(EventBase):
    pid: int | None = None


class Started(_PidEvent):
    type: Literal["started"]
    world_size: int | None = None
    device: str | None = None
    device_name: str | None = None
    precision: str | None = None
    sync_batchnorm: bool | None = None
    deterministic: bool | None = None
    versions: dict[str, str | None] | None = None
    resumed_from: str | None = None
    epoch: Number | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    loader: str | None = None
    train_samples: int | None = None
    val_samples: int | None = None
    parameters: int | None = None


class MetricEvent(EventBase):
    type: Literal["metric"]
    epoch: Number | None = None
    name: str | None = None
    value: Number | None = None  # null: the trainer saw a NaN or an infinity


class CheckpointEvent(EventBase):
    type: Literal["checkpoint"]
    epoch: Number | None = None
    path: str | None = None
    bytes: int | None = None
    sha256: str | None = None
    kind: str = "resume"  # "resume" | "weights"; the worker refuses any other
    pruned: list[str] | None = None


class ArtifactEvent(EventBase):
    type: Literal["artifact"]
    name: str | None = None
    path: str | None = None  # always ARTIFACT_DIR/name: the worker refuses any other
    bytes: int | None = None
    sha256: str | None = None


class Progress(EventBase):
    type: Literal["progress"]
    total_steps: int | None = None
    epoch: Number | None = None
    samples_per_s: Number | None = None
    eta_s: Number | None = None


class Finished(_PidEvent):
    type: Literal["finished"]
    epoch: Number | None = None
    metrics: dict[str, Number | None] | None = None


class Stopped(_PidEvent):
    type: Literal["stopped"]
    signal: str | None = None
    checkpoint: str | None = None


class RungEvent(EventBase):
    type: Literal["rung"]
    index: int | None = None  # the evaluation's index, from 1 (the pruner's resource)
    name: str | None = None  # the objective
    value: Number | None = None  # null: not finite


class ErrorEvent(_PidEvent):
    type: Literal["error"]
    # nonfinite_loss, out_of_memory, data, storage_full, peer_failed, unsupported or
    # internal (trainer/failures.py); any string is kept when reading
    kind: str | None = None
    message: str | None = None
    rank: int | None = None


Event = Annotated[
    Started
    | MetricEvent
    | CheckpointEvent
    | ArtifactEvent
    | Progress
    | Finished
    | Stopped
    | ErrorEvent
    | RungEvent,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: dict[str, type[EventBase]] = {
    "started": Started,
    "metric": MetricEvent,
    "checkpoint": CheckpointEvent,
    "artifact": ArtifactEvent,
    "progress": Progress,
    "finished": Finished,
    "stopped": Stopped,
    "error": ErrorEvent,
    "rung": RungEvent,
}


def parse_event(data: dict[str, Any]) -> Event:
    """A decoded event (ValidationError when its type is unknown or a field is mistyped)."""
    return _ADAPTER.validate_python(data)


def parse_event_line(line: bytes | str) -> Event:
    """One line of an events file (ValidationError when it is not a valid event)."""
    return _ADAPTER.validate_json(line)


def build_event(data: dict[str, Any]) -> dict[str, Any]:
    """The event to write, checked: `data` itself (its keys and order are the line's) when
    every field is one its type declares, with the declared JSON type; ValueError naming
    the problem otherwise."""
    kind = data.get("type")
    model = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"unknown event type {data.get('type')!r}: one of {sorted(EVENT_TYPES)}")
    unknown = data.keys() - model.model_fields.keys()
    if unknown:
        raise ValueError(f"{data['type']} event: undeclared field(s) {sorted(unknown)}")
    model.model_validate(data)  # ValidationError is a ValueError
    return data


def event_dict(event: EventBase) -> dict[str, Any]:
    """An event as the plain dict it was read from (what Outcome and decide() take)."""
    return event.model_dump(exclude_unset=True)


# ---- what the worker takes ------------------------------------------------------------------

MAX_INT63 = 2**63 - 1  # the store's BIGINT
MAX_INT31 = 2**31 - 1  # the store's INTEGER (attempt numbers), and pids and ranks
# Integer fields held to 32 bits; every other declared integer to 63 bits, both non-negative.
_INT31_FIELDS = frozenset({"attempt", "pid", "rank", "world_size"})
_INT_FIELDS = frozenset(
    {"step", "bytes", "total_steps", "steps_per_epoch", "train_samples", "val_samples",
     "parameters", "index"} | _INT31_FIELDS
)  # fmt: skip
ERROR_KINDS = frozenset(
    {"nonfinite_loss", "out_of_memory", "data", "storage_full", "peer_failed", "unsupported",
     "internal", "user_code", "init", "spec", "run_dir_full", "model_too_large"}
)  # fmt: skip
"""Every `error` kind a trainer writes (trainer/failures.py), and `run_dir_full`, the
worker's own (the run directory over TORCHYARD_MAX_RUN_DIR_BYTES)."""
HOST_FAULT_KINDS = frozenset({"storage_full"})
"""Kinds that blame the host, not the job: the worker believes them only on its own evidence."""
CHECKPOINT_KINDS = ("resume", "weights")
MAX_ARTIFACTS = 1000  # distinct artifact names a job may keep (each is a row)
MAX_PATH_CHARS = 500  # the store's checkpoint path column
MAX_PRUNED = 1000  # paths one checkpoint event may report deleted
_SHA256 = re.compile(r"[0-9a-f]{64}")
ARTIFACT_DIR = "artifacts"  # the run dir's folder of `job.save_artifact`'s files
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
"""An artifact's name: 1 to 128 of `A-Z a-z 0-9 . _ -`, not starting with a dot (so never
`.`, `..` nor a hidden or temporary file); a file name alone, no folder."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class EventLimits:
    """What the worker takes from one job's events files (TORCHYARD_MAX_EVENT_LINE_BYTES,
    TORCHYARD_MAX_METRIC_NAME_CHARS, TORCHYARD_MAX_METRIC_NAMES)."""

    line_bytes: int = 64 * 1024
    metric_name_chars: int = 100
    metric_names: int = 1000
    artifacts: int = MAX_ARTIFACTS


def _int_problem(key: str, v: int) -> str | None:
    top = MAX_INT31 if key in _INT31_FIELDS else MAX_INT63
    if 0 <= v <= top:
        return None
    shown = str(v) if abs(v) < 10**30 else f"of {v.bit_length()} bits"
    return f"{key} {shown} is outside 0..{top}"


def _value_problem(key: str, v: Any, depth: int = 0) -> str | None:
    """A value of no declared integer field: numbers finite, strings without NUL, nested
    lists and objects alike (a few levels deep at most)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        try:
            ok = math.isfinite(float(v))
        except OverflowError:
            ok = False
        return None if ok else f"{key} is not a finite number"
    if isinstance(v, str):
        return f"{key} holds a NUL character" if "\x00" in v else None
    if depth >= 4:
        return f"{key} is nested too deeply"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        if isinstance(k, str) and "\x00" in k:
            return f"{key} has a key with a NUL character"
        problem = _value_problem(f"{key}.{k}", x, depth + 1)
        if problem:
            return problem
    return None


def _path_problem(key: str, path: str) -> str | None:
    """A path inside the run directory, relative, as the store keeps it."""
    if not path or len(path) > MAX_PATH_CHARS:
        return f"{key} must be 1 to {MAX_PATH_CHARS} characters"
    if path.startswith("/") or "\\" in path or _CONTROL.search(path):
        return f"{key} {path[:80]!r} must be a plain path relative to the run directory"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return f"{key} {path[:80]!r} must stay inside the run directory (no '..', '.' or '//')"
    return None


def _checkpoint_problem(ev: CheckpointEvent) -> str | None:
    if ev.kind not in CHECKPOINT_KINDS:
        return f"checkpoint kind {ev.kind[:40]!r} is not one of {', '.join(CHECKPOINT_KINDS)}"
    if ev.path is not None and (problem := _path_problem("checkpoint path", ev.path)):
        return problem
    if ev.sha256 is not None and not _SHA256.fullmatch(ev.sha256):
        return "checkpoint sha256 must be 64 lowercase hex digits"
    if ev.pruned is not None:
        if len(ev.pruned) > MAX_PRUNED:
            return f"checkpoint pruned lists more than {MAX_PRUNED} paths"
        for p in ev.pruned:
            if problem := _path_problem("checkpoint pruned path", p):
                return problem
    return None


def artifact_name_problem(name: object) -> str | None:
    """Why `name` is not an artifact name (None: it is one)."""
    if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
        shown = repr(name)[:80]
        return (
            f"artifact name {shown} must be 1 to 128 of A-Z, a-z, 0-9, '.', '_', '-', "
            "not starting with '.'"
        )
    return None


def _artifact_problem(ev: ArtifactEvent) -> str | None:
    if problem := artifact_name_problem(ev.name):
        return problem
    if ev.path != f"{ARTIFACT_DIR}/{ev.name}":
        return f"artifact path {str(ev.path)[:80]!r} must be {ARTIFACT_DIR}/<its name>"
    if ev.sha256 is not None and not _SHA256.fullmatch(ev.sha256):
        return "artifact sha256 must be 64 lowercase hex digits"
    return None


# The worker's system metrics (worker/sysmetrics.py) are the only series under this prefix:
# a trainer's event naming one is set aside, so a job cannot forge its own GPU use.
SYS_PREFIX = "sys/"


def _typed_problem(ev: EventBase, limits: EventLimits) -> str | None:
    """The rules of one event type."""
    if isinstance(ev, MetricEvent | RungEvent) and ev.name is not None:
        if ev.name.startswith(SYS_PREFIX):  # what the worker measures, not what a job says
            return f"metric name {ev.name[:40]!r}: {SYS_PREFIX} is the worker's system metrics"
        if len(ev.name) > limits.metric_name_chars:
            return f"metric name of {len(ev.name)} characters (at most {limits.metric_name_chars})"
        if not ev.name or _CONTROL.search(ev.name):
            return "metric name is empty or holds control characters"
    elif isinstance(ev, CheckpointEvent):
        return _checkpoint_problem(ev)
    elif isinstance(ev, ArtifactEvent):
        return _artifact_problem(ev)
    elif isinstance(ev, ErrorEvent) and ev.kind is not None and ev.kind not in ERROR_KINDS:
        return f"error kind {ev.kind[:40]!r} is not a known kind"
    return None


def event_problem(ev: EventBase, limits: EventLimits = EventLimits()) -> str | None:
    """Why the worker must not take this parsed event (None: it may): see the module's
    docstring. Checks the event alone; the worker counts a job's distinct metric names."""
    for key, v in ev.model_dump(exclude_none=True).items():
        if key in _INT_FIELDS and isinstance(v, int) and not isinstance(v, bool):
            problem = _int_problem(key, v)
        elif key == "value" and isinstance(ev, MetricEvent | RungEvent):
            problem = _value_problem(key, v) if isinstance(v, int) else None  # nan: not kept
        else:
            problem = _value_problem(key, v)
        kind = getattr(ev, "type", "an")
        if problem:
            return f"{kind} event: {problem}"
    problem = _typed_problem(ev, limits)
    return f"{getattr(ev, 'type', 'an')} event: {problem}" if problem else None
