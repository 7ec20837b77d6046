"""Reading the trainer's events.jsonl as it grows, and writing what it says to the store
in batches (one transaction per batch, idempotent: metrics on (job, name, step),
checkpoints on (job, path), artifacts on (job, name)).

Each batch commits, with its rows, the byte offset it reaches (the attempt's
`events_offset`), and is fenced by the attempt: a supervisor whose attempt was ended
elsewhere cannot write. Whoever supervises the job next ingests from the furthest
committed offset, so a store outage of any length loses nothing. Events of another
attempt than the recorder's (a previous trainer's last lines) are recorded (metrics,
checkpoints) but never change the job's state.

Every line is parsed by the trainer's event model (contracts/eventmodel.py) and checked
against its rules (`event_problem`) and the worker's limits (`EventLimits`: a line's size,
a job's distinct metric names) before anything of it reaches the store. A line that fails,
and a batch the store refuses (store/ingest.py `refused_by_store`), is set aside
(`SetAside`): counted, reported in the job log and in the attempt's reason, never retried.
Stored files are read through the storage seam
(`EventTail.open`, `last_rank_event_at`, `end_torn_line_at`); a local `Path` (the run
directory's own file, which this host's trainer writes) is read as a file."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from torchyard.contracts.eventmodel import (
    CHECKPOINT_KINDS,
    ArtifactEvent,
    CheckpointEvent,
    ErrorEvent,
    Event,
    EventLimits,
    MetricEvent,
    Progress,
    RungEvent,
    Started,
    Stopped,
    ValidationError,
    event_dict,
    event_problem,
    parse_event,
    parse_event_line,
)
from torchyard.settings import Settings
from torchyard.storage import Storage, Tail, beneath
from torchyard.storage.local import FileTail
from torchyard.store.artifacts import record_artifact
from torchyard.store.attempts import fence_flush, note_attempt
from torchyard.store.checkpoints import mark_deleted, record_checkpoint, unrecorded_files
from torchyard.store.ingest import refused_by_store
from torchyard.store.lifecycle import mark_started
from torchyard.store.metrics import ingest_metrics
from torchyard.store.paths import UnsafePath
from torchyard.worker.publish import (
    CheckpointGone,
    CheckpointRefused,
    CheckpointUploads,
    UploadPending,
)
from torchyard.worker.runfiles import quoted

log = logging.getLogger(__name__)

PROGRESS_KEYS = ("step", "total_steps", "epoch", "samples_per_s", "eta_s")
NOTES_LOGGED = 50  # set-aside lines one recorder names in the job log; later ones are counted
TAIL_BATCH = 2000  # lines the supervision loop takes per turn (bounded work between polls)


def _parse(line: bytes) -> Event | str:
    """The event of one line, or why it is not one."""
    try:
        return parse_event_line(line)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)[:3]
        log.warning("skipping a malformed event line (%d bytes): %s", len(line), errors)
        loc = errors[0]["loc"] if errors else ()
        msg = errors[0]["msg"] if errors else "invalid"
        where = ".".join(str(x) for x in loc)
        return f"not a valid event ({where + ': ' if where else ''}{msg})"


@dataclass
class SetAside:
    """Lines (or a refused batch's points) the worker did not take: counted, the first
    reasons kept for the job log (`take_log_lines`) and the attempt's reason (`summary`)."""

    count: int = 0
    first: str | None = None
    notes: list[str] = field(default_factory=list)  # not yet in the job log
    unnamed: int = 0  # set aside past NOTES_LOGGED, not yet in the job log
    named: int = 0  # notes ever taken for the log

    def add(self, why: str, n: int = 1) -> None:
        self.count += n
        self.first = self.first or why
        if self.named + len(self.notes) < NOTES_LOGGED:
            self.notes.append(why if n == 1 else f"{n} points: {why}")
        else:
            self.unnamed += n

    def take_log_lines(self) -> list[str]:
        """What to append to the job log since the last call."""
        lines = [
            f"===== torchyard: event line set aside: {quoted(why)} =====\n" for why in self.notes
        ]
        if self.unnamed:
            lines.append(
                f"===== torchyard: {self.unnamed} more event lines set aside "
                f"({self.count} in all) =====\n"
            )
        self.named += len(self.notes)
        self.notes, self.unnamed = [], 0
        return lines

    def summary(self) -> str | None:
        """For the attempt's reason: how many, and the first reason."""
        if not self.count:
            return None
        return f"{self.count} event line(s) set aside (the first: {self.first}); see the job log"


def _last_rank_event(data: bytes, attempt: int) -> dict[str, Any] | None:
    found = None
    for line in data.splitlines():
        try:
            ev = parse_event_line(line)
        except ValidationError:  # a torn last line: the rank was killed mid-write
            continue
        if event_problem(ev) is not None:
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
        data = beneath.read_file(path.parent, path.name, RANK_EVENTS_READ, start)
    except (OSError, UnsafePath):
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
    being written stays buffered until its newline arrives, up to `max_line` bytes: a
    longer one is dropped as it comes (never held whole) and reported in `bad`, as is every
    line that is not an event. `source`: a local file, or a storage tail opened at
    `offset` (`EventTail.open`)."""

    def __init__(self, source: Path | Tail, offset: int = 0, max_line: int = 64 * 1024):
        self.offset = offset
        self.max_line = max_line
        self._tail: Tail = FileTail(source, offset) if isinstance(source, Path) else source
        self._partial = b""
        self._lines: deque[tuple[bytes, int]] = deque()  # complete lines not yet returned
        self._queued = 0  # their bytes in the file (newlines counted)
        self._skipping = False  # inside a line over max_line: dropped up to its newline
        self.bad: list[str] = []  # why each line not returned was refused, until taken

    @classmethod
    def open(
        cls, storage: Storage, key: str, offset: int = 0, max_line: int = 64 * 1024
    ) -> EventTail:
        """The stored events file `key`, from byte `offset`."""
        return cls(storage.open_tail(key, offset), offset, max_line)

    @property
    def consumed(self) -> int:
        """Offset just past the last line returned (lines queued or partial not counted)."""
        return self.offset - len(self._partial) - self._queued

    @staticmethod
    def size_of(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def _too_long(self, n: int | None = None) -> str:
        size = f"{n} bytes" if n is not None else f"more than {self.max_line} bytes"
        return f"a line of {size} (TORCHYARD_MAX_EVENT_LINE_BYTES is {self.max_line})"

    def _split(self, data: bytes, final: bool) -> None:
        """Queue the complete lines of `data` (after what was partial)."""
        if self._skipping:
            cut = data.find(b"\n")
            if cut < 0:
                data = b""
            else:
                data, self._skipping = data[cut + 1 :], False
                self.bad.append(self._too_long())
        parts = (self._partial + data).split(b"\n")
        self._partial = parts.pop()
        for line in parts:
            self._lines.append((line, len(line) + 1))
        self._queued += sum(len(line) + 1 for line in parts)
        if len(self._partial) > self.max_line:
            self._partial, self._skipping = b"", True
        if final:
            if self._partial:
                self._lines.append((self._partial, len(self._partial)))
                self._queued += len(self._partial)
                self._partial = b""
            if self._skipping:
                self._skipping = False
                self.bad.append(self._too_long())

    def read(self, final: bool = False, limit: int | None = None) -> list[Event]:
        """Events completed since the last call, at most `limit` lines' worth (the rest
        stays queued for the next call); with `final`, also a last unterminated line."""
        data = self._tail.read()
        self.offset += len(data)
        more = bool(getattr(self._tail, "more", False))  # a slice of a larger backlog
        self._split(data, final and not more)
        out: list[Event] = []
        n = len(self._lines) if limit is None else min(limit, len(self._lines))
        for _ in range(n):
            line, size = self._lines.popleft()
            self._queued -= size
            if not line.strip():
                continue
            if len(line) > self.max_line:
                self.bad.append(self._too_long(len(line)))
                continue
            ev = _parse(line)
            if isinstance(ev, str):
                self.bad.append(ev)
            else:
                out.append(ev)
        return out

    @property
    def drained(self) -> bool:
        """No complete line is waiting to be returned, nor unread bytes the last read left."""
        return not self._lines and not getattr(self._tail, "more", False)

    def take_bad(self) -> list[str]:
        bad, self.bad = self.bad, []
        return bad

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
    """The store row of a metric event (checked by `event_problem` first); None when it has
    no name, step or finite value (a NaN loss is written as null: not recorded)."""
    value, when = _num(ev.value), _num(ev.time)
    if ev.name is None or ev.step is None or value is None:
        return None
    return {
        "name": ev.name,
        "step": ev.step,
        "epoch": _num(ev.epoch),
        "value": value,
        "time": when if when is not None else 0.0,
    }


Tx = Callable[[Callable[[Session], Any]], Any]  # runs a function in one transaction


def event_limits(settings: Settings) -> EventLimits:
    """The worker's limits on what it takes from a job's events files."""
    return EventLimits(
        line_bytes=settings.max_event_line_bytes,
        metric_name_chars=settings.max_metric_name_chars,
        metric_names=settings.max_metric_names,
    )


@dataclass
class EventRecorder:
    """Buffers events of one attempt and writes them in one fenced transaction per flush.

    `attempt_number` None records events for the record only (a backlog of earlier
    attempts): nothing in it moves the job or counts as this attempt's outcome. `names`:
    the job's distinct metric names so far (read from the store before the first batch;
    a backlog's recorder and the attempt's share one set)."""

    job_id: str
    attempt_id: int
    attempt_number: int | None
    outcome: Outcome = field(default_factory=Outcome)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    started_pending: bool = False
    offset: int | None = None  # where the buffered events end in the file
    limits: EventLimits = field(default_factory=EventLimits)
    names: set[str] = field(default_factory=set)
    # `job.save_artifact`'s files of the batch, the last event of each name (an earlier
    # one's file was replaced by the later one's); the job's artifact names so far.
    artifacts: list[ArtifactEvent] = field(default_factory=list)
    artifact_names: set[str] = field(default_factory=set)
    set_aside: SetAside = field(default_factory=SetAside)
    # Where the run dir is not the stored objects: checkpoints go up before their rows.
    uploads: CheckpointUploads | None = None
    waiting_upload: bool = False  # the last commit waited for an upload
    # What checkpoints that were never stored (superseded, or gone) had pruned: their rows
    # still stop being listed.
    pruned_unrecorded: list[str] = field(default_factory=list)
    # (path, sha256) of the rows the last write marked deleted: their stored objects go.
    pruned_stored: list[tuple[str, str]] = field(default_factory=list)
    # Checkpoints of the batch a later one pruned after their upload had begun: their
    # objects go too, unless a row names them.
    dropped_uploads: list[tuple[str, str]] = field(default_factory=list)
    _reported: int = 0  # set-aside count last written to the attempt's reason
    # This attempt's trainer waits at these rungs for the pruner (worker/supervisor.py).
    rungs: list[RungEvent] = field(default_factory=list)
    # A local run dir: (sha256, bytes) of a checkpoint as the worker reads it, by its path
    # relative to the run dir. What is recorded is measured, never the event's word.
    measure: Callable[[str], tuple[str, int]] | None = None
    _measured: dict[str, tuple[str, int]] = field(default_factory=dict)

    def _own(self, ev: Event) -> bool:
        if self.attempt_number is None:
            return False
        # A trainer started by hand (no TORCHYARD_ATTEMPT) writes no attempt number.
        return ev.attempt is None or ev.attempt == self.attempt_number

    def _refused(self, ev: Event) -> str | None:
        """Why this event is not taken (its own rules, then the job's name budget)."""
        problem = event_problem(ev, self.limits)
        if problem is None and isinstance(ev, ArtifactEvent) and ev.name is not None:
            return self._artifact_refused(ev.name)
        if problem is not None or not isinstance(ev, MetricEvent) or ev.name is None:
            return problem
        if ev.name not in self.names:
            if len(self.names) >= self.limits.metric_names:
                return (
                    f"metric {ev.name!r}: the job has {len(self.names)} metric names already "
                    f"(TORCHYARD_MAX_METRIC_NAMES is {self.limits.metric_names})"
                )
            self.names.add(ev.name)
        return None

    def _artifact_refused(self, name: str) -> str | None:
        if name not in self.artifact_names:
            if len(self.artifact_names) >= self.limits.artifacts:
                return (
                    f"artifact {name!r}: the job has {len(self.artifact_names)} artifacts "
                    f"already (at most {self.limits.artifacts})"
                )
            self.artifact_names.add(name)
        return None

    def add(self, ev: Event | dict[str, Any], offset: int | None = None) -> None:
        """Buffer one event (a dict is parsed first: ValidationError if it is not one); an
        event the rules refuse is set aside instead."""
        if isinstance(ev, dict):
            ev = parse_event(ev)
        if offset is not None:
            self.offset = offset
        why = self._refused(ev)
        if why is not None:
            self.set_aside.add(why)
            return
        if isinstance(ev, MetricEvent):
            row = _metric_row(ev)
            if row is not None:
                self.metrics.append(row)
        elif (
            isinstance(ev, CheckpointEvent) and ev.kind in CHECKPOINT_KINDS and ev.path is not None
        ):
            self.checkpoints.append(ev)
        elif isinstance(ev, ArtifactEvent):
            self._replace_artifact(ev)
        if self._own(ev):
            self._follow(ev)

    def _replace_artifact(self, ev: ArtifactEvent) -> None:
        """`ev` in the batch in place of an earlier save of its name, whose upload (begun
        for bytes the file no longer holds) is let go and its object dropped."""
        for a in self.artifacts:
            path = a.path or ""
            if a.name == ev.name and self.uploads is not None and self.uploads.started(path):
                self.uploads.forget([path])
                if a.sha256 and a.sha256 != ev.sha256:
                    self.dropped_uploads.append((path, a.sha256))
        self.artifacts = [a for a in self.artifacts if a.name != ev.name] + [ev]

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
        elif isinstance(ev, RungEvent):
            self.rungs.append(ev)

    def add_all(self, tail: EventTail, final: bool = False, limit: int | None = None) -> int:
        """Buffer what `tail` has (at most `limit` lines); the lines it refused are set
        aside. Returns the number of events read."""
        events = tail.read(final=final, limit=limit)
        for ev in events:
            self.add(ev)
        for why in tail.take_bad():
            self.set_aside.add(why)
        self.offset = tail.offset if final and tail.drained else tail.consumed
        return len(events)

    @property
    def pending(self) -> int:
        return (
            len(self.metrics)
            + len(self.checkpoints)
            + len(self.artifacts)
            + int(self.progress is not None)
            + int(self.started_pending)
            + int(self.set_aside.count != self._reported)
        )

    def _write_checkpoint(self, session: Session, c: CheckpointEvent) -> None:
        """One checkpoint row, in a savepoint: one the store refuses is set aside alone."""
        marked: list[tuple[str, str]] = []
        try:
            with session.begin_nested():
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
                # keep_last deleted these files: stop listing them for download or resume.
                if c.pruned is not None:
                    marked = mark_deleted(session, self.job_id, c.pruned)
            self.pruned_stored += marked  # only once its savepoint held
        except (UnsafePath, ValueError, TypeError) as e:
            log.warning("checkpoint event refused: %s", e)
            self.set_aside.add(f"checkpoint event refused: {e}")
        except Exception as e:
            if not refused_by_store(e):
                raise
            self.set_aside.add(f"checkpoint {c.path!r}: the store refused it ({_short(e)})")

    def _write_artifact(self, session: Session, a: ArtifactEvent) -> None:
        """One artifact row, in a savepoint; the object of the file it replaced goes."""
        try:
            with session.begin_nested():
                before = record_artifact(session, self.job_id, name=a.name or "",
                                         bytes=a.bytes or 0, sha256=a.sha256 or "")  # fmt: skip
            if before is not None:
                self.pruned_stored.append((a.path or "", before))
        except (UnsafePath, ValueError, TypeError) as e:
            self.set_aside.add(f"artifact event refused: {e}")
        except Exception as e:
            if not refused_by_store(e):
                raise
            self.set_aside.add(f"artifact {a.name!r}: the store refused it ({_short(e)})")

    def write(self, session: Session) -> None:
        """Write the buffer in the caller's transaction, fenced by the attempt (raises
        store.lifecycle.Fenced when it has ended); `clear()` after it commits."""
        progress, self.pruned_stored = None, []  # a retried write starts over
        if self.progress is not None and self.attempt_number is not None:
            progress = (self.attempt_number, self.progress)
        report = self.set_aside.count != self._reported
        # The fence, the events offset and the job's version (its ETag: a 304 must not hide
        # new rows) with its progress, in one round trip: all commit with the rows or none.
        fence_flush(
            session,
            self.attempt_id,
            self.offset,
            touch_job=bool(
                self.metrics or self.checkpoints or self.artifacts or progress or report
            ),
            progress=progress,
        )
        if self.started_pending:
            mark_started(session, self.attempt_id)
        if self.metrics:
            ingest_metrics(session, self.job_id, self.metrics)
        for c in self.checkpoints:
            self._write_checkpoint(session, c)
        for a in self.artifacts:
            self._write_artifact(session, a)
        if self.pruned_unrecorded:
            self.pruned_stored += mark_deleted(session, self.job_id, self.pruned_unrecorded)
        if self.dropped_uploads:
            self.pruned_stored += unrecorded_files(session, self.job_id, self.dropped_uploads)
        if report:
            note_attempt(session, self.attempt_id, self.set_aside.summary())

    def commit(self, tx: Tx) -> None:
        """`write` the buffer through `tx` and `clear()` it. A batch the store refuses for
        what it holds is not sent again as it was: its metric points are set aside and the
        rest written; if that is refused too, its checkpoints and progress go as well and
        only the fence, the offset and the start are written. Fenced, a lost connection and
        anything else propagate (the buffer is kept); so does UploadPending while a
        checkpoint of the batch is not durable in the object store yet."""
        self._await_uploads()
        self._measure()
        for stage in range(3):
            try:
                tx(self.write)
                break
            except Exception as e:
                if stage == 2 or not refused_by_store(e):
                    raise
                self._drop(stage, e)
        if self.uploads is not None:
            self.uploads.forget([c.path or "" for c in self.checkpoints])
            self.uploads.forget([a.path or "" for a in self.artifacts])
            self.uploads.forget([p for p, _ in self.dropped_uploads])
            self.uploads.delete_pruned(self.pruned_stored)
        self.clear()

    def _await_uploads(self) -> None:
        """Every checkpoint of the batch durable in the object store, or UploadPending (the
        uploads go on in their thread); one that never can be is set aside. A checkpoint a
        later one of the batch pruned is not uploaded at all (a trainer checkpointing faster
        than the store takes them sends only what it keeps), and one whose file is gone
        is skipped: either way what it pruned still stops being listed."""
        self.waiting_upload = False
        if self.uploads is None:
            return
        pending = self._await_artifact_uploads(self.uploads)
        if not self.checkpoints:
            self._pending_uploads(pending)
            return
        superseded = {p for c in self.checkpoints for p in c.pruned or []}
        keep = []
        for c in self.checkpoints:
            try:
                if c.path in superseded:
                    if self.uploads.started(c.path) and c.sha256:  # it may have gone up
                        self.dropped_uploads.append((c.path, c.sha256))
                    raise CheckpointGone(f"checkpoint {c.path!r}: pruned before it was stored")
                pending += not self.uploads.ready(c)
            except CheckpointGone as e:
                log.info("job %s: %s", self.job_id, e)
                self.pruned_unrecorded.extend(c.pruned or [])
                continue
            except CheckpointRefused as e:
                self.set_aside.add(str(e))
                self.pruned_unrecorded.extend(c.pruned or [])
                continue
            keep.append(c)
        self.checkpoints = keep
        self._pending_uploads(pending)

    def _pending_uploads(self, pending: int) -> None:
        if pending:
            self.waiting_upload = True
            raise UploadPending(f"{pending} file(s) still going up to the object store")

    def _await_artifact_uploads(self, uploads: CheckpointUploads) -> int:
        """The artifacts of the batch: how many are not durable yet; one that never can be
        (a link, or replaced by a later save before it went up) is dropped."""
        keep, pending = [], 0
        for a in self.artifacts:
            try:
                pending += not uploads.ready(a)
            except CheckpointRefused as e:
                log.info("job %s: artifact %s not stored: %s", self.job_id, a.name, e)
                continue
            keep.append(a)
        self.artifacts = keep
        return pending

    def _measure(self) -> None:
        """Each checkpoint of the batch gets the sha256 and size the worker measured: read
        from the run dir by descriptor (a local one) or counted while it went up (an
        object store). One whose bytes do not hash to what its event announced, or whose
        file cannot be read, is set aside; what it pruned still stops being listed."""
        self._measure_artifacts()
        keep = []
        for c in self.checkpoints:
            path = c.path or ""
            try:
                got = self._measured_file(path)
            except FileNotFoundError:  # pruned by a later save already (keep_last)
                log.info("job %s: checkpoint %s is gone before it was recorded",
                         self.job_id, path)  # fmt: skip
                self.pruned_unrecorded.extend(c.pruned or [])
                continue
            except (OSError, UnsafePath) as e:
                self.set_aside.add(f"checkpoint {path}: its file cannot be read ({e})")
                self.pruned_unrecorded.extend(c.pruned or [])
                continue
            if got is None:  # nothing measures (a recorder of its own, in tests)
                keep.append(c)
                continue
            if c.sha256 and c.sha256 != got[0]:
                self.set_aside.add(
                    f"checkpoint {path}: its file does not match the sha256 its event announced"
                )
                self.pruned_unrecorded.extend(c.pruned or [])
                continue
            keep.append(c.model_copy(update={"sha256": got[0], "bytes": got[1]}))
        self.checkpoints = keep

    def _measured_file(self, path: str) -> tuple[str, int] | None:
        """(sha256, bytes) of a file of the batch as the worker measured it (counted on its
        way up, or read by descriptor now); None when nothing measures."""
        got = self._measured.get(path)
        if got is None and self.uploads is not None:
            got = self.uploads.measured.get(path)
        if got is None and self.measure is not None:
            got = self._measured[path] = self.measure(path)
        return got

    def _measure_artifacts(self) -> None:
        """Each artifact gets the sha256 and size the worker measured. One whose file is gone
        or no longer holds the bytes its event announced was replaced by a later save
        (whose own event records it) or tampered with: it is not recorded."""
        keep = []
        for a in self.artifacts:
            try:
                got = self._measured_file(a.path or "")
            except (OSError, UnsafePath) as e:
                self.set_aside.add(f"artifact {a.name}: its file cannot be read ({e})")
                continue
            if got is not None and a.sha256 and a.sha256 != got[0]:
                log.info("job %s: artifact %s changed before it was recorded", self.job_id, a.name)
                continue
            keep.append(
                a if got is None else a.model_copy(update={"sha256": got[0], "bytes": got[1]})
            )
        self.artifacts = keep

    def _drop(self, stage: int, e: BaseException) -> None:
        why = f"the store refused the batch ({_short(e)})"
        log.warning("job %s: %s; setting it aside", self.job_id, why)
        if stage == 0 and self.metrics:
            self.set_aside.add(f"{len(self.metrics)} metric points: {why}", len(self.metrics))
            self.metrics = []
            return
        n = len(self.metrics) + len(self.checkpoints) + len(self.artifacts)
        n += int(self.progress is not None)
        self.set_aside.add(f"{n} events: {why}", max(n, 1))
        self.metrics, self.checkpoints, self.artifacts, self.progress = [], [], [], None

    def clear(self) -> None:
        """After `write` committed: the buffer is in the store, the set-aside count too."""
        self.metrics, self.checkpoints, self.pruned_unrecorded = [], [], []
        self.artifacts = []
        self.pruned_stored, self.dropped_uploads = [], []
        self.progress, self.started_pending = None, False
        self._reported = self.set_aside.count
        self._measured.clear()


def _short(e: BaseException) -> str:
    """An exception in one line of at most 200 characters (a driver's text can be long)."""
    orig = getattr(e, "orig", None) or e
    text = " ".join(str(orig).split())
    return f"{type(orig).__name__}: {text[:200]}"
