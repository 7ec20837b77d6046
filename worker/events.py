"""Reading the trainer's events.jsonl as it grows, and writing what it says to the store
in batches (one transaction per batch, idempotent: metrics on (job, name, step),
checkpoints on (job, path)).

Each batch commits, with its rows, the byte offset it reaches (the attempt's
`events_offset`), and is fenced by the attempt: a supervisor whose attempt was ended
elsewhere cannot write. Whoever supervises the job next ingests from the furthest
committed offset, so a store outage of any length loses nothing. Events of another
attempt than the recorder's (a previous trainer's last lines) are recorded (metrics,
checkpoints) but never change the job's state."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from torchyard.store.attempts import set_events_offset
from torchyard.store.checkpoints import mark_deleted, record_checkpoint
from torchyard.store.lifecycle import fence, mark_started
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job
from torchyard.store.paths import UnsafePath

log = logging.getLogger(__name__)

PROGRESS_KEYS = ("step", "total_steps", "epoch", "samples_per_s", "eta_s")
CHECKPOINT_KINDS = ("resume", "weights")


def last_rank_event(path: Path, start: int, attempt: int) -> dict[str, Any] | None:
    """The last `error` or `stopped` event of `attempt` that a rank other than 0 wrote to
    its own file (trainer/eventfiles.py) past byte `start`; None if there is none."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read(1 << 20)  # a rank writes a line or two per attempt
    except OSError:
        return None
    found = None
    for line in data.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(ev, dict)
            and ev.get("attempt") == attempt
            and ev.get("type")
            in (
                "error",
                "stopped",
            )
        ):
            found = ev
    return found


class EventTail:
    """New complete JSON lines of an append-only file, from a byte offset on. A line still
    being written stays buffered until its newline arrives."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset
        self._f: Any = None
        self._partial = b""

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
        if self._f is None:
            try:
                self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 (kept open)
            except FileNotFoundError:
                return b""
            self._f.seek(self.offset)
        out = []
        while True:
            b = self._f.read(1 << 20)
            if not b:
                break
            out.append(b)
        data = b"".join(out)
        self.offset += len(data)
        return data

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        """Events completed since the last call; with `final`, also a last unterminated line."""
        data = self._partial + self._chunks()
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                log.warning("skipping a malformed event line (%d bytes)", len(line))
                continue
            if isinstance(ev, dict) and isinstance(ev.get("type"), str):
                events.append(ev)
        return events

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


@dataclass
class Outcome:
    """What the events said about how the run ended (read by the supervisor)."""

    started: bool = False
    finished: bool = False
    error: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None
    last_step: int | None = None


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
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    started_pending: bool = False
    offset: int | None = None  # where the buffered events end in the file

    def _own(self, ev: dict[str, Any]) -> bool:
        if self.attempt_number is None:
            return False
        n = ev.get("attempt")
        # A trainer started by hand (no TORCHYARD_ATTEMPT) writes no attempt number.
        return n is None or n == self.attempt_number

    def add(self, ev: dict[str, Any], offset: int | None = None) -> None:
        if offset is not None:
            self.offset = offset
        t = ev.get("type")
        if t == "metric":
            value, when = _num(ev.get("value")), _num(ev.get("time"))
            if (
                isinstance(ev.get("name"), str)
                and isinstance(ev.get("step"), int)
                and value is not None
            ):
                self.metrics.append(
                    {
                        "name": ev["name"][:100],
                        "step": ev["step"],
                        "epoch": _num(ev.get("epoch")),
                        "value": value,
                        "time": when if when is not None else 0.0,
                    }
                )
        elif (
            t == "checkpoint"
            and ev.get("kind", "resume") in CHECKPOINT_KINDS
            and isinstance(ev.get("path"), str)
        ):
            self.checkpoints.append(ev)
        if not self._own(ev):
            return
        if isinstance(ev.get("step"), int):
            self.outcome.last_step = ev["step"]
        if t == "progress":
            self.progress = {k: ev.get(k) for k in PROGRESS_KEYS}
        elif t == "started":
            self.outcome.started = True
            self.started_pending = True
        elif t == "finished":
            self.outcome.finished = True
        elif t == "error":
            self.outcome.error = ev
        elif t == "stopped":
            self.outcome.stopped = ev

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

    def write(self, session: Session) -> None:
        """Write the buffer in the caller's transaction, fenced by the attempt (raises
        store.lifecycle.Fenced when it has ended); `clear()` after it commits."""
        fence(session, self.attempt_id)
        if self.started_pending:
            mark_started(session, self.attempt_id)
        if self.metrics:
            ingest_metrics(session, self.job_id, self.metrics)
        for c in self.checkpoints:
            attempt = c.get("attempt")
            try:
                record_checkpoint(
                    session,
                    self.job_id,
                    attempt=attempt if isinstance(attempt, int) else (self.attempt_number or 0),
                    step=int(c.get("step") or 0),
                    epoch=_num(c.get("epoch")),
                    path=c["path"],
                    bytes=int(c.get("bytes") or 0),
                    sha256=str(c.get("sha256") or ""),
                    kind=c.get("kind", "resume"),
                )
            except (UnsafePath, ValueError, TypeError) as e:
                log.warning("checkpoint event refused: %s", e)
            # keep_last deleted these files: stop listing them for download or resume.
            pruned = c.get("pruned")
            if isinstance(pruned, list):
                mark_deleted(session, self.job_id, [p for p in pruned if isinstance(p, str)])
        if self.progress is not None and self.attempt_number is not None:
            session.execute(
                update(Job)
                .where(Job.id == self.job_id, Job.attempt == self.attempt_number)
                .values(progress=self.progress)
                .execution_options(synchronize_session=False)
            )
        if self.offset is not None:
            set_events_offset(session, self.attempt_id, self.offset)

    def clear(self) -> None:
        self.metrics, self.checkpoints = [], []
        self.progress, self.started_pending = None, False
