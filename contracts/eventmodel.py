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
    progress    step, total_steps, epoch, samples_per_s, eta_s
    finished    step, epoch, metrics
    stopped     signal, step, checkpoint
    error       kind, message, step, rank

Every event may carry `time` (Unix seconds; the trainer always writes it), `attempt` (the
job's attempt number; absent when the trainer runs by hand) and `pid` (`started`,
`finished`, `stopped`, `error`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "EVENT_TYPES",
    "Event",
    "EventBase",
    "ValidationError",
    "build_event",
    "event_dict",
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


class ErrorEvent(_PidEvent):
    type: Literal["error"]
    # nonfinite_loss, out_of_memory, data, storage_full, peer_failed, unsupported or
    # internal (trainer/failures.py); any string is kept when reading
    kind: str | None = None
    message: str | None = None
    rank: int | None = None


Event = Annotated[
    Started | MetricEvent | CheckpointEvent | Progress | Finished | Stopped | ErrorEvent,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: dict[str, type[EventBase]] = {
    "started": Started,
    "metric": MetricEvent,
    "checkpoint": CheckpointEvent,
    "progress": Progress,
    "finished": Finished,
    "stopped": Stopped,
    "error": ErrorEvent,
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
