"""Running one assignment (one rank of one attempt) on this worker: take the lease, write
the spec, meet the other ranks, start the trainer, follow its events into the store,
act on cancel / stop / a lost attempt, and record how it ended.

Outcome rules (rank 0 reads the events; other ranks only see their exit status):
- exit 0 -> succeeded (rank 0 decides; other ranks just end their part);
- an `error` event -> failed with "kind: message"; nonfinite_loss, data and
  out_of_memory are deterministic (retrying gives the same) so the job fails at once,
  other kinds are retried while restarts remain;
- the worker stopping (SIGTERM) -> handed back: the job is queued again, not counted;
- killed by a signal (OOM killer, SIGKILL) -> lost: retried from the latest checkpoint;
- cancel requested -> cancelled (succeeded still wins if it finished first).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import select

from store.attempts import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_SUCCEEDED,
    ATTEMPT_ACTIVE,
    claim_assignment,
    end_assignment,
    finish_attempt,
    latest_resume_checkpoint,
    mark_launched,
    read_endpoint,
    set_endpoint,
)
from store.db import session_scope
from store.models import Attempt, Job
from store.paths import EVENTS_FILE, LOG_FILE, SPEC_FILE, job_dir
from store.settings import Settings
from store.states import CANCELLING
from trainer import exitcodes
from worker.events import EventRecorder, EventTail
from worker.identity import Device
from worker.proc import (
    Launch,
    describe_exit,
    free_port,
    signal_group,
    spawn,
    trainer_argv,
    trainer_env,
)

log = logging.getLogger(__name__)

POLL_S = 0.1  # event tail and process poll
STATE_POLL_S = 0.5  # job/attempt state in the store (cancel seen well within 2 s)
FLUSH_S = 0.5
FLUSH_EVENTS = 500
STOP_GRACE_MIN_S = 30.0  # a stopping worker gives its trainer this long to checkpoint
PEER_DECIDES_S = 5.0  # a failed non-zero rank lets rank 0 (which has the events) decide first
DETERMINISTIC_ERRORS = frozenset({"nonfinite_loss", "data", "out_of_memory"})

T = TypeVar("T")


@dataclass
class WorkerContext:
    """What a running assignment needs from its worker process."""

    settings: Settings
    worker_id: str
    device: Device
    advertise_addr: str
    stopping: threading.Event = field(default_factory=threading.Event)
    current_assignment: int | None = None
    # Test hook and diagnostics: called with the trainer's pid once it is started.
    on_launch: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Claimed:
    assignment_id: int
    attempt_id: int
    attempt_number: int
    job_id: str
    rank: int
    world_size: int
    spec: dict[str, Any]
    cancelling: bool


def _retry(what: str, fn: Callable[[], T], tries: int = 30, wait_s: float = 1.0) -> T:
    """Store writes that must not be lost (an attempt's end) survive a database blip."""
    for i in range(tries):
        try:
            return fn()
        except Exception as e:
            if i == tries - 1:
                raise
            log.warning("%s failed (%s); retrying", what, e)
            time.sleep(wait_s)
    raise AssertionError("unreachable")


def claim(ctx: WorkerContext, assignment_id: int) -> Claimed | None:
    with session_scope(ctx.settings.db_url) as s:
        a = claim_assignment(s, assignment_id, ctx.worker_id)
        if a is None:
            return None
        attempt = s.get(Attempt, a.attempt_id)
        job = s.get(Job, a.job_id)
        assert attempt is not None and job is not None
        return Claimed(
            assignment_id=a.id,
            attempt_id=attempt.id,
            attempt_number=attempt.number,
            job_id=job.id,
            rank=a.rank,
            world_size=attempt.world_size,
            spec=dict(job.spec),
            cancelling=job.state == CANCELLING or job.cancel_requested,
        )


class Supervision:
    def __init__(self, ctx: WorkerContext, c: Claimed):
        self.ctx, self.c = ctx, c
        self.db = ctx.settings.db_url
        self.run_dir = job_dir(ctx.settings.storage, c.job_id)
        self.recorder = EventRecorder(c.job_id, c.attempt_id, c.attempt_number)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_why: str | None = None  # cancel | stopping | ended
        self.resume_rel: str | None = None

    # ---- launch -------------------------------------------------------------------------

    def _write_spec(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / SPEC_FILE
        tmp = self.run_dir / f".{SPEC_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.c.spec, indent=2, sort_keys=True))
        os.replace(tmp, path)
        return path

    def _rendezvous(self) -> tuple[str, int] | None:
        """Rank 0 publishes host:port; the others wait for it (None: gave up)."""
        if self.c.world_size == 1:
            return None
        if self.c.rank == 0:
            addr, port = self.ctx.advertise_addr, free_port()
            with session_scope(self.db) as s:
                set_endpoint(s, self.c.attempt_id, f"{addr}:{port}")
            return addr, port
        deadline = time.monotonic() + self.ctx.settings.rendezvous_timeout_s
        while time.monotonic() < deadline and not self.ctx.stopping.is_set():
            with session_scope(self.db) as s:
                endpoint, state = read_endpoint(s, self.c.attempt_id)
            if state not in ATTEMPT_ACTIVE:
                raise _AttemptOver
            if endpoint:
                host, _, port = endpoint.rpartition(":")
                return host, int(port)
            time.sleep(0.2)
        return None

    def _log_line(self, text: str) -> None:
        fd = os.open(self.run_dir / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def launch(self, master: tuple[str, int] | None, spec_path: Path, resume: Path | None) -> None:
        launch = Launch(
            spec_path=spec_path,
            run_dir=self.run_dir,
            resume=resume,
            world_size=self.c.world_size,
            rank=self.c.rank,
            master_addr=master[0] if master else None,
            master_port=master[1] if master else None,
        )
        now = datetime.now(UTC).isoformat(timespec="seconds")
        start = f"resuming from {self.resume_rel}" if self.resume_rel else "fresh start"
        self._log_line(
            f"===== torchyard: attempt {self.c.attempt_number}, rank {self.c.rank}/"
            f"{self.c.world_size}, worker {self.ctx.worker_id}, {now}, {start} =====\n"
        )
        env = trainer_env(
            data_root=self.ctx.settings.data,
            cuda_visible=self.ctx.device.cuda_visible,
            threads=self.ctx.settings.trainer_threads,
        )
        self.tail = EventTail(
            self.run_dir / EVENTS_FILE, EventTail.size_of(self.run_dir / EVENTS_FILE)
        )
        fd = os.open(self.run_dir / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            self.proc = spawn(trainer_argv(launch), env=env, cwd=self.run_dir, log_fd=fd)
        finally:
            os.close(fd)
        if self.ctx.on_launch is not None:
            self.ctx.on_launch(self.proc.pid)
        pid = self.proc.pid
        _retry(
            "recording the trainer pid",
            lambda: self._in_tx(
                lambda s: mark_launched(s, self.c.assignment_id, pid, resumed_from=self.resume_rel)
            ),
        )
        log.info(
            "job %s attempt %d rank %d: trainer pid %d",
            self.c.job_id,
            self.c.attempt_number,
            self.c.rank,
            pid,
        )

    def _in_tx(self, fn: Callable[[Any], T]) -> T:
        with session_scope(self.db) as s:
            return fn(s)

    # ---- supervision --------------------------------------------------------------------

    def _flush(self) -> None:
        if not self.recorder.pending:
            return
        try:
            with session_scope(self.db) as s:
                self.recorder.write(s)
            self.recorder.clear()
        except Exception as e:  # kept in the buffer; the next flush retries
            log.warning("event flush failed (%s); will retry", e)

    def _poll_store(self) -> tuple[str | None, str | None]:
        with session_scope(self.db) as s:
            row = s.execute(
                select(Job.state, Attempt.state)
                .join(Attempt, Attempt.job_id == Job.id)
                .where(Attempt.id == self.c.attempt_id)
            ).first()
        return (row[0], row[1]) if row else (None, None)

    def _stop(self, why: str, sig: int, grace_s: float | None) -> float | None:
        assert self.proc is not None
        self.stop_why = why
        log.info(
            "job %s: %s -> sending %s to the trainer", self.c.job_id, why, signal.Signals(sig).name
        )
        if sig == signal.SIGKILL:
            signal_group(self.proc, sig)
        else:
            # SIGTERM to the leader only (the trainer, or torchrun which forwards it once):
            # a second SIGTERM would make the trainer die without its checkpoint, and loader
            # workers must not die under it.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
        return None if grace_s is None else time.monotonic() + grace_s

    def supervise(self) -> int:
        assert self.proc is not None
        rank0 = self.c.rank == 0
        settings = self.ctx.settings
        kill_at: float | None = None
        last_poll = last_flush = time.monotonic()
        while True:
            rc = self.proc.poll()
            if rank0:
                for ev in self.tail.read():
                    self.recorder.add(ev)
                now = time.monotonic()
                if self.recorder.pending and (
                    now - last_flush >= FLUSH_S or self.recorder.pending >= FLUSH_EVENTS
                ):
                    self._flush()
                    last_flush = now
            if rc is not None:
                break
            now = time.monotonic()
            if self.stop_why is None and now - last_poll >= STATE_POLL_S:
                last_poll = now
                try:
                    job_state, att_state = self._poll_store()
                except Exception as e:
                    log.warning("store poll failed (%s)", e)
                    job_state, att_state = None, "unknown"
                if att_state is None or (
                    att_state not in ATTEMPT_ACTIVE and att_state != "unknown"
                ):
                    # Someone else ended this attempt (the reaper, another rank): the job
                    # may already run elsewhere, so this trainer must not write another byte.
                    kill_at = self._stop("attempt ended elsewhere", signal.SIGKILL, None)
                    self.stop_why = "ended"
                elif job_state == CANCELLING:
                    kill_at = self._stop(
                        "cancel requested", signal.SIGTERM, settings.cancel_grace_s
                    )
                    self.stop_why = "cancel"
            if self.stop_why is None and self.ctx.stopping.is_set():
                grace = max(settings.cancel_grace_s, STOP_GRACE_MIN_S)
                kill_at = self._stop("worker stopping", signal.SIGTERM, grace)
                self.stop_why = "stopping"
            if kill_at is not None and now >= kill_at:
                log.warning(
                    "job %s: trainer still alive after the grace period; SIGKILL", self.c.job_id
                )
                signal_group(self.proc, signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_S)
        # Whatever the trainer left in its group (torchrun ranks, loader workers) goes too.
        signal_group(self.proc, signal.SIGKILL)
        if rank0:
            for ev in self.tail.read(final=True):
                self.recorder.add(ev)
            self.tail.close()
            for _ in range(20):
                self._flush()
                if not self.recorder.pending:
                    break
                time.sleep(0.5)
        return rc

    # ---- the end ------------------------------------------------------------------------

    def _decide(self, rc: int) -> tuple[str, str, str | None, bool] | None:
        """(attempt outcome, reason, job error, retryable), or None to leave it to others."""
        o = self.recorder.outcome
        wid = self.ctx.worker_id
        step = f" at step {o.last_step}" if o.last_step is not None else ""
        if self.stop_why == "ended":
            return None
        job_state, att_state = _retry("reading the job state", self._poll_store)
        if att_state not in ATTEMPT_ACTIVE:
            return None
        if self.stop_why == "cancel" or job_state == CANCELLING:
            if rc == exitcodes.OK and o.finished:
                return A_SUCCEEDED, "finished before the cancel arrived", None, False
            return A_CANCELLED, f"cancelled{step}", None, False
        if self.stop_why == "stopping":
            return (
                A_HANDED_BACK,
                f"worker {wid} stopping; trainer {describe_exit(rc)}{step}",
                None,
                False,
            )
        # Rank 0's `finished` event comes after the final checkpoint and weights are written:
        # the job is done even if torchrun's exit code says a rank stumbled while exiting.
        if rc == exitcodes.OK or (o.finished and o.error is None):
            if self.c.rank == 0:
                return A_SUCCEEDED, "finished", None, False
            return None
        if o.error is not None:
            kind = str(o.error.get("kind", "internal"))
            msg = f"{kind}: {o.error.get('message', '')}".strip()
            return A_FAILED, msg, msg, kind not in DETERMINISTIC_ERRORS
        if o.stopped is not None or rc == exitcodes.PREEMPTED:
            return A_HANDED_BACK, f"trainer preempted by a SIGTERM from outside{step}", None, False
        if rc == exitcodes.BAD_SPEC:
            msg = "the trainer refused the spec or its arguments (exit 2); see the job log"
            return A_FAILED, msg, msg, False
        if rc in (exitcodes.NONFINITE_LOSS, exitcodes.OUT_OF_MEMORY):
            msg = f"{exitcodes.NAMES[rc]} (exit {rc}); see the job log"
            return A_FAILED, msg, msg, False
        if self.c.rank != 0:
            # Rank 0 has the events and usually the real error: let it decide first.
            deadline = time.monotonic() + PEER_DECIDES_S
            while time.monotonic() < deadline:
                if self._poll_store()[1] not in ATTEMPT_ACTIVE:
                    return None
                time.sleep(0.2)
        if rc < 0:
            return A_LOST, f"rank {self.c.rank} trainer {describe_exit(rc)}{step}", None, True
        msg = f"rank {self.c.rank} trainer {describe_exit(rc)}{step}; see the job log"
        return A_FAILED, msg, msg, True

    def finish(
        self, rc: int | None, decision: tuple[str, str, str | None, bool] | None
    ) -> str | None:
        def tx(s: Any) -> str | None:
            end_assignment(s, self.c.assignment_id, rc)
            if decision is None:
                return None
            outcome, reason, error, retryable = decision
            return finish_attempt(
                s,
                self.c.attempt_id,
                outcome,
                exit_code=rc,
                reason=reason,
                error=error,
                retryable=retryable,
            )

        state = _retry("recording the attempt's end", lambda: self._in_tx(tx))
        if decision is not None:
            log.info(
                "job %s attempt %d rank %d: %s (%s) -> job %s",
                self.c.job_id,
                self.c.attempt_number,
                self.c.rank,
                decision[0],
                decision[1],
                state,
            )
        return state

    def run(self) -> None:
        if self.c.cancelling:
            self.finish(None, (A_CANCELLED, "cancelled before it started", None, False))
            return
        try:
            spec_path = self._write_spec()
            with session_scope(self.db) as s:
                found = latest_resume_checkpoint(s, self.c.job_id, self.run_dir)
            resume = None
            if found is not None:
                self.resume_rel, resume = found
            master = self._rendezvous()
            if self.c.world_size > 1 and master is None:
                if self.ctx.stopping.is_set():
                    self.finish(
                        None, (A_HANDED_BACK, f"worker {self.ctx.worker_id} stopping", None, False)
                    )
                else:
                    t = self.ctx.settings.rendezvous_timeout_s
                    why = f"rendezvous: rank 0's endpoint not published within {t:g}s"
                    self.finish(None, (A_LOST, why, None, True))
                return
            self.launch(master, spec_path, resume)
        except _AttemptOver:
            self.finish(None, None)
            return
        except Exception as e:
            log.exception("job %s: launch failed", self.c.job_id)
            if self.proc is not None:
                signal_group(self.proc, signal.SIGKILL)
                self.proc.wait()
            self.finish(
                None, (A_FAILED, f"launch failed on worker {self.ctx.worker_id}: {e}", None, True)
            )
            return
        try:
            rc = self.supervise()
        except BaseException:
            # Never leave a trainer behind an exception in the worker.
            signal_group(self.proc, signal.SIGKILL)
            raise
        self._log_line(
            f"===== torchyard: attempt {self.c.attempt_number}, rank {self.c.rank}: "
            f"trainer {describe_exit(rc)} =====\n"
        )
        self.finish(rc, self._decide(rc))


class _AttemptOver(Exception):
    """The attempt ended while this rank was still getting ready."""


def run_assignment(ctx: WorkerContext, assignment_id: int) -> bool:
    """The RUN_TASK body. Returns False when the message was a duplicate or stale (the
    lease was already taken or the attempt is over): nothing was started."""
    c = claim(ctx, assignment_id)
    if c is None:
        log.info(
            "assignment %s: not claimable here (duplicate or stale message); ignored", assignment_id
        )
        return False
    ctx.current_assignment = c.assignment_id
    try:
        Supervision(ctx, c).run()
    finally:
        ctx.current_assignment = None
    return True
