"""Reading the trainer's events.jsonl as it grows, and writing what it says to the store
in batches (one transaction per batch, idempotent: metrics on (job, name, step),
checkpoints on (job, path)).

Each batch commits, with its rows, the byte offset it reaches (the attempt's
`events_offset`), and is fenced by the attempt: a supervisor whose attempt was ended
elsewhere cannot write. Whoever supervises the job next ingests from the furthest
committed offset, so a store outage of any length loses nothing. Events of another
attempt than the recorder's (a previous trainer's last lines) are recorded (metrics,
checkpoints) but never change the job's state.

Every line is parsed by the trainer's event model (contracts/eventmodel.py); a line that is
not a valid event is logged and skipped. Stored files are read through the storage seam
(`EventTail.open`, `last_rank_event_at`, `end_torn_line_at`); a local `Path` (the run
directory's own file, which this host's trainer writes) is read as a file."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from torchyard.contracts.eventmodel import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    MetricEvent,
    Progress,
    Started,
    Stopped,
    ValidationError,
    event_dict,
    parse_event,
    parse_event_line,
)
from torchyard.storage import Storage, Tail
from torchyard.storage.local import FileTail
from torchyard.store.attempts import fence_flush
from torchyard.store.checkpoints import mark_deleted, record_checkpoint
from torchyard.store.lifecycle import mark_started
from torchyard.store.metrics import ingest_metrics
from torchyard.store.paths import UnsafePath

log = logging.getLogger(__name__)

PROGRESS_KEYS = ("step", "total_steps", "epoch", "samples_per_s", "eta_s")
CHECKPOINT_KINDS = ("resume", "weights")


def _parse(line: bytes) -> Event | None:
    try:
        return parse_event_line(line)
    except ValidationError as e:
        log.warning(
            "skipping a malformed event line (%d bytes): %s",
            len(line),
            e.errors(include_url=False, include_input=False)[:3],
        )
        return None


def _last_rank_event(data: bytes, attempt: int) -> dict[str, Any] | None:
    found = None
    for line in data.splitlines():
        try:
            ev = parse_event_line(line)
        except ValidationError:  # a torn last line: the rank was killed mid-write
            continue
        if isinstance(ev, ErrorEvent | Stopped) and ev.attempt == attempt:
            found = ev
    return None if found is None else event_dict(found)


RANK_EVENTS_READ = 1 << 20  # a rank writes a line or two per attempt


def last_rank_event(path: Path, start: int, attempt: int) -> dict[str, Any] | None:
    """The last `error` or `stopped` event of `attempt` that a rank other than 0 wrote to
    its own file (contracts/eventfiles.py) past byte `start`, as written; None if there is
    none."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read(RANK_EVENTS_READ)
    except OSError:
        return None
    return _last_rank_event(data, attempt)


def last_rank_event_at(
    storage: Storage, key: str, start: int, attempt: int
) -> dict[str, Any] | None:
    """`last_rank_event` of the stored file `key`."""
    try:
        data, _ = storage.read_range(key, start, RANK_EVENTS_READ)
    except OSError:
        return None
    return _last_rank_event(data, attempt)


def end_torn_line_at(storage: Storage, key: str) -> None:
    """End a last line that a kill or a full disk left without its newline, so the next
    trainer's first line is not glued onto it (nothing to do for a missing object or one
    that ends in a newline)."""
    try:
        size = storage.stat(key).size
        if size and storage.read_range(key, size - 1, 1)[0] != b"\n":
            storage.append(key, b"\n")
    except FileNotFoundError:
        return


class EventTail:
    """New complete JSON lines of an append-only file, from a byte offset on. A line still
    being written stays buffered until its newline arrives. `source`: a local file, or a
    storage tail opened at `offset` (`EventTail.open`)."""

    def __init__(self, source: Path | Tail, offset: int = 0):
        self.offset = offset
        self._tail: Tail = FileTail(source, offset) if isinstance(source, Path) else source
        self._partial = b""

    @classmethod
    def open(cls, storage: Storage, key: str, offset: int = 0) -> EventTail:
        """The stored events file `key`, from byte `offset`."""
        return cls(storage.open_tail(key, offset), offset)

    @property
    def consumed(self) -> int:
        """Offset just past the last complete line returned (a partial line not counted)."""
        return self.offset - len(self._partial)

    @staticmethod
    def size_of(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def _chunks(self) -> bytes:
        data = self._tail.read()
        self.offset += len(data)
        return data

    def read(self, final: bool = False) -> list[Event]:
        """Events completed since the last call; with `final`, also a last unterminated line."""
        data = self._partial + self._chunks()
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        parsed = (_parse(line) for line in lines if line.strip())
        return [ev for ev in parsed if ev is not None]

    def close(self) -> None:
        self._tail.close()


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass
class Outcome:
    """What the events said about how the run ended (read by the supervisor); `error` and
    `stopped` are the events as written (worker/outcome.py reads them as dicts)."""

    started: bool = False
    finished: bool = False
    error: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None
    last_step: int | None = None


def _metric_row(ev: MetricEvent) -> dict[str, Any] | None:
    """The store row of a metric event; None when it has no name, step or finite value."""
    value, when = _num(ev.value), _num(ev.time)
    if ev.name is None or ev.step is None or value is None:
        return None
    return {
        "name": ev.name[:100],
        "step": ev.step,
        "epoch": _num(ev.epoch),
        "value": value,
        "time": when if when is not None else 0.0,
    }


@dataclass
class EventRecorder:
    """Buffers events of one attempt and writes them in one fenced transaction per flush.

    `attempt_number` None records events for the record only (a backlog of earlier
    attempts): nothing in it moves the job or counts as this attempt's outcome."""

    job_id: str
    attempt_id: int
    attempt_number: int | None
    outcome: Outcome = field(default_factory=Outcome)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    started_pending: bool = False
    offset: int | None = None  # where the buffered events end in the file

    def _own(self, ev: Event) -> bool:
        if self.attempt_number is None:
            return False
        # A trainer started by hand (no TORCHYARD_ATTEMPT) writes no attempt number.
        return ev.attempt is None or ev.attempt == self.attempt_number

    def add(self, ev: Event | dict[str, Any], offset: int | None = None) -> None:
        """Buffer one event (a dict is parsed first: ValidationError if it is not one)."""
        if isinstance(ev, dict):
            ev = parse_event(ev)
        if offset is not None:
            self.offset = offset
        if isinstance(ev, MetricEvent):
            row = _metric_row(ev)
            if row is not None:
                self.metrics.append(row)
        elif (
            isinstance(ev, CheckpointEvent) and ev.kind in CHECKPOINT_KINDS and ev.path is not None
        ):
            self.checkpoints.append(ev)
        if self._own(ev):
            self._follow(ev)

    def _follow(self, ev: Event) -> None:
        """What this attempt's own event says about the run."""
        if ev.step is not None:
            self.outcome.last_step = ev.step
        if isinstance(ev, Progress):
            self.progress = {k: getattr(ev, k) for k in PROGRESS_KEYS}
        elif isinstance(ev, Started):
            self.outcome.started = True
            self.started_pending = True
        elif ev.type == "finished":
            self.outcome.finished = True
        elif isinstance(ev, ErrorEvent):
            self.outcome.error = event_dict(ev)
        elif isinstance(ev, Stopped):
            self.outcome.stopped = event_dict(ev)

    def add_all(self, tail: EventTail, final: bool = False) -> int:
        events = tail.read(final=final)
        for ev in events:
            self.add(ev)
        self.offset = tail.offset if final else tail.consumed
        return len(events)

    @property
    def pending(self) -> int:
        return (
            len(self.metrics)
            + len(self.checkpoints)
            + int(self.progress is not None)
            + int(self.started_pending)
        )

    def _write_checkpoint(self, session: Session, c: CheckpointEvent) -> None:
        try:
            record_checkpoint(
                session,
                self.job_id,
                attempt=c.attempt if c.attempt is not None else (self.attempt_number or 0),
                step=c.step or 0,
                epoch=_num(c.epoch),
                path=c.path or "",
                bytes=c.bytes or 0,
                sha256=c.sha256 or "",
                kind=c.kind,
            )
        except (UnsafePath, ValueError, TypeError) as e:
            log.warning("checkpoint event refused: %s", e)
        # keep_last deleted these files: stop listing them for download or resume.
        if c.pruned is not None:
            mark_deleted(session, self.job_id, c.pruned)

    def write(self, session: Session) -> None:
        """Write the buffer in the caller's transaction, fenced by the attempt (raises
        store.lifecycle.Fenced when it has ended); `clear()` after it commits."""
        progress = None
        if self.progress is not None and self.attempt_number is not None:
            progress = (self.attempt_number, self.progress)
        # The fence, the events offset and the job's version (its ETag: a 304 must not hide
        # new rows) with its progress, in one round trip: all commit with the rows or none.
        fence_flush(
            session,
            self.attempt_id,
            self.offset,
            touch_job=bool(self.metrics or self.checkpoints or progress),
            progress=progress,
        )
        if self.started_pending:
            mark_started(session, self.attempt_id)
        if self.metrics:
            ingest_metrics(session, self.job_id, self.metrics)
        for c in self.checkpoints:
            self._write_checkpoint(session, c)

    def clear(self) -> None:
        self.metrics, self.checkpoints = [], []
        self.progress, self.started_pending = None, False
