"""Reading the trainer's events.jsonl as it grows, and writing what it says to the store
in batches (one transaction per batch, idempotent: metrics on (job, name, step),
checkpoints on (job, path))."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from store.attempts import mark_attempt_running
from store.checkpoints import mark_deleted, record_checkpoint
from store.metrics import ingest_metrics
from store.models import Job
from store.paths import UnsafePath
from store.states import RUNNING, STARTING, IllegalTransition, transition

log = logging.getLogger(__name__)

PROGRESS_KEYS = ("step", "total_steps", "epoch", "samples_per_s", "eta_s")
CHECKPOINT_KINDS = ("resume", "weights")


class EventTail:
    """New complete JSON lines of an append-only file, from a byte offset on. A line still
    being written stays buffered until its newline arrives."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset
        self._f: Any = None
        self._partial = b""

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
    """Buffers events of one attempt and writes them in one transaction per flush."""

    job_id: str
    attempt_id: int
    attempt_number: int
    outcome: Outcome = field(default_factory=Outcome)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    started_pending: bool = False

    def add(self, ev: dict[str, Any]) -> None:
        t = ev.get("type")
        if isinstance(ev.get("step"), int):
            self.outcome.last_step = ev["step"]
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
        elif t == "checkpoint":
            if ev.get("kind", "resume") in CHECKPOINT_KINDS and isinstance(ev.get("path"), str):
                self.checkpoints.append(ev)
        elif t == "progress":
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

    @property
    def pending(self) -> int:
        return (
            len(self.metrics)
            + len(self.checkpoints)
            + int(self.progress is not None)
            + int(self.started_pending)
        )

    def write(self, session: Session) -> None:
        """Write the buffer in the caller's transaction; `clear()` after it commits."""
        if self.started_pending:
            mark_attempt_running(session, self.attempt_id)
            job = session.get(Job, self.job_id, populate_existing=True)
            if job is not None and job.state == STARTING and job.attempt == self.attempt_number:
                with contextlib.suppress(IllegalTransition):  # cancelled meanwhile
                    transition(
                        session, job, RUNNING, reason=f"attempt {self.attempt_number} started"
                    )
        if self.metrics:
            ingest_metrics(session, self.job_id, self.metrics)
        for c in self.checkpoints:
            try:
                record_checkpoint(
                    session,
                    self.job_id,
                    attempt=self.attempt_number,
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
        if self.progress is not None:
            session.execute(
                update(Job)
                .where(Job.id == self.job_id, Job.attempt == self.attempt_number)
                .values(progress=self.progress)
                .execution_options(synchronize_session=False)
            )

    def clear(self) -> None:
        self.metrics, self.checkpoints = [], []
        self.progress, self.started_pending = None, False
