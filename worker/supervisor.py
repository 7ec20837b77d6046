"""Running one assignment (one rank of one attempt) on this worker: take the lease, ingest
what earlier attempts left unrecorded, write the spec, meet the other ranks, have the
slot's launcher start the trainer, follow its events into the store, act on cancel / stop /
a lost attempt, and record how it ended. Where and how the trainer runs is the launcher's
(worker/launcher.py): this module talks only to its `TrainerHandle`. What earlier attempts
stored (events, the checkpoint to resume from) is read through the storage seam
(torchyard.storage); the files of the local run directory the worker writes itself are
worker/runfiles.py's. How an ending is classified is `worker/outcome.py`; what it does to
the job is `store.lifecycle.finish_attempt`.

Faults, and what this module does about them:
- the store is unreachable: events stay buffered (never dropped) and their offset is
  committed with them, so nothing is lost however long the outage; the watchdog
  (`worker/watchdog.py`) stops the trainer before the reaper could give the job away;
- the trainer has exited: recording the end is retried until the store answers or says
  the attempt is over (a fenced write), never abandoned;
- the attempt was ended elsewhere: every write is fenced, the trainer is killed;
- an earlier attempt died with its last checkpoint unrecorded: rank 0 records it, then
  picks the checkpoint and publishes the pick with its endpoint; every rank resumes from
  that one (`_prepare`), so a gang never starts a step apart.
"""

from __future__ import annotations

import errno
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import tenacity
from sqlalchemy import exc

from torchyard.contracts.eventfiles import rank_events_file
from torchyard.contracts.rungs import PAUSED_AT
from torchyard.settings import Settings
from torchyard.storage import Storage, beneath, run_dir, storage_for
from torchyard.storage.base import ChecksumMismatch
from torchyard.storage.keys import UnsafePath, job_key
from torchyard.storage.local import LocalStorage
from torchyard.store.artifacts import artifact_names
from torchyard.store.attempts import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_SUCCEEDED,
    ATTEMPT_ACTIVE,
    AttemptStatus,
    Claimed,
    attempt_hosts,
    attempt_status,
    claim_rank,
    end_assignment,
    finish_attempt,
    ingest_start,
    mark_launched,
    read_endpoint,
    resume_pick,
    set_endpoint,
)
from torchyard.store.checkpoints import recorded_sha256
from torchyard.store.db import session_scope
from torchyard.store.lifecycle import Fenced
from torchyard.store.metrics import metric_names
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, rank_log_file
from torchyard.store.pruning import Pruning
from torchyard.store.sandboxuids import sandbox_uid
from torchyard.store.states import CANCELLING
from torchyard.worker.events import (
    TAIL_BATCH,
    EventRecorder,
    EventTail,
    end_torn_line_at,
    event_limits,
    last_rank_event,
)
from torchyard.worker.identity import Device, is_loopback
from torchyard.worker.inputs import InputError, code_dir, data_ready, init_file, init_source
from torchyard.worker.launcher import (
    Launcher,
    LaunchRequest,
    SandboxRefused,
    TrainerHandle,
    choose_launcher,
)
from torchyard.worker.metrics import WorkerMetrics
from torchyard.worker.outcome import (
    STOP_CANCEL,
    STOP_PAUSED,
    STOP_PREEMPT,
    STOP_PRUNED,
    STOP_STORE_LOST,
    STOP_WORKER,
    Decision,
    Ending,
    decide,
    describe_exit,
)
from torchyard.worker.proc import Launch, free_port, runs_code, slot_env, trainer_argv
from torchyard.worker.publish import (
    CheckpointUploads,
    LogShipper,
    UploadPending,
    align_events,
    log_key_for_rank,
)
from torchyard.worker.runfiles import append_to_log, claim_log, file_size, write_spec_file
from torchyard.worker.rungs import Rungs, prepare_rungs
from torchyard.worker.runlimits import free_description, run_dir_over, storage_evidence
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.sysmetrics import SystemSampler, record_samples

log = logging.getLogger(__name__)

POLL_S = 0.1  # event tail and process poll
STATE_POLL_S = 0.5  # job/attempt state in the store (cancel seen well within 2 s)
FLUSH_S = 0.5
FLUSH_EVENTS = 500
PRUNE_GRACE_S = 5.0  # a pruned trial's trainer exits at once; one that does not is killed
STOP_GRACE_MIN_S = 30.0  # a stopping worker gives its trainer this long to checkpoint
# A stopping worker gives up on the store this long after it saw its SIGTERM (the attempt
# is then the reaper's): within `torchyard up`'s 45 s, however ingest or the store fails.
STOP_DEADLINE_S = 40.0
# How long a launch waits for the checkpoints an earlier attempt left on this host to go up.
BACKLOG_UPLOAD_WAIT_S = 300.0
PEER_DECIDES_S = 5.0  # a failed non-zero rank lets rank 0 (which has the events) decide first
RETRY_FIRST_WAIT_S, RETRY_MAX_WAIT_S = 0.2, 5.0
# What a store outage raises. Anything else is a bug: it propagates (the worker releases
# itself and the reaper ends the attempt it no longer supervises) rather than retrying forever.
TRANSIENT = (exc.OperationalError, exc.InterfaceError, exc.TimeoutError, OSError)

T = TypeVar("T")


@dataclass
class WorkerContext:
    """What a running assignment needs from its worker process, and what the worker's
    heartbeat and watchdog threads read of it."""

    settings: Settings
    worker_id: str
    device: Device
    advertise_addr: str
    stopping: threading.Event = field(default_factory=threading.Event)
    current_assignment: int | None = None
    # Test hook and diagnostics: called with the trainer's pid once it is started.
    on_launch: Callable[[int], None] | None = None
    # monotonic time of the last store round trip that succeeded (any thread)
    store_ok_at: float = field(default_factory=time.monotonic)
    # monotonic time the supervision loop last went round (None: not supervising)
    loop_beat: float | None = None
    # the watchdog's lease refreshes (monotonic): the last, and the longest gap since the
    # current trainer's launch (worker/outcome.py: a stop the worker did not ask for)
    lease_at: float | None = None
    lease_gap: float = 0.0
    # the running trainer (its launcher's handle), which the watchdog may stop
    trainer: TrainerHandle | None = None
    # set by the watchdog when it stopped the trainer because the store was out of reach
    store_lost_stop: threading.Event = field(default_factory=threading.Event)
    # the running trainer's run dir, which the watchdog measures (None: not supervising);
    # what it found: the run dir over TORCHYARD_MAX_RUN_DIR_BYTES (it stopped the trainer),
    # and when it last saw the run dir's file system (nearly) full (monotonic time)
    watch_dir: Path | None = None
    run_dir_full: str | None = None
    low_space_at: float | None = None
    # added to the trainer's environment (the watchdog's lease)
    extra_env: dict[str, str] = field(default_factory=dict)
    # this slot's warm trainer, taken by a one-rank launch (None: every trainer starts cold)
    warm: WarmTrainer | None = None
    # how this slot starts trainers; None: made on first use, as the settings say
    # (worker/launcher.py choose_launcher), and kept: it owns the slot's sandbox folders
    launcher: Launcher | None = None
    # sweep trials' verdicts at their rungs (made at the first trial with rungs, kept)
    pruning: Pruning | None = None
    # the worker's Prometheus metrics (worker/metrics.py), served when a port is given
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)

    def store_ok(self) -> None:
        self.store_ok_at = time.monotonic()

    def lease_refreshed(self, now: float) -> None:
        """The watchdog refreshed the trainer's lease: keep the longest gap between two."""
        if self.lease_at is not None:
            self.lease_gap = max(self.lease_gap, now - self.lease_at)
        self.lease_at = now

    def lease_lapsed_since(self, start: float, stop_after_s: float) -> bool:
        """Whether the lease went as stale as the trainer stops at, since `start`."""
        now = time.monotonic()
        last = self.lease_at if self.lease_at is not None else start
        return self.lease_gap >= stop_after_s or now - max(last, start) >= stop_after_s

    def trainer_launcher(self) -> Launcher:
        """This slot's launcher (made once, over the slot's warm trainer)."""
        if self.launcher is None:
            self.launcher = choose_launcher(self.settings, self.warm)
        return self.launcher


def retry_until(
    what: str,
    fn: Callable[[], T],
    *,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """Store writes that must not be lost (an attempt's end) are retried with backoff until
    they succeed, however long the outage. `Fenced` is an answer, not a fault, and other
    errors are bugs: both are raised at once. `give_up` ends the wait early by re-raising
    the last error."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TRANSIENT),
        wait=tenacity.wait_exponential(multiplier=RETRY_FIRST_WAIT_S, max=RETRY_MAX_WAIT_S),
        stop=lambda _: give_up(),
        reraise=True,
        before_sleep=lambda rs: log.warning(
            "%s failed (%s); retrying in %.1fs",
            what,
            rs.outcome.exception() if rs.outcome else None,
            rs.next_action.sleep if rs.next_action else 0.0,
        ),
    )(fn)


def claim(ctx: WorkerContext, assignment_id: int) -> Claimed | None:
    with session_scope(ctx.settings.db_url) as s:
        return claim_rank(s, assignment_id, ctx.worker_id)


class Rendezvous(NamedTuple):
    """What every rank of an attempt agrees on before its launch."""

    master: tuple[str, int] | None  # rank 0's (host, port); None for one rank
    resumed_from: str | None  # rank 0's pick, relative to the run dir; None: fresh start


class Prepared(NamedTuple):
    """What the launch needs, found before it."""

    spec_path: Path
    resume: Path | None  # the checkpoint to resume from
    master: tuple[str, int] | None  # rank 0's rendezvous (host, port); None for one rank
    events_start: int  # where this attempt's own lines begin in events.jsonl
    code_dir: Path | None = None  # the job's unpacked code bundle
    init: Path | None = None  # the weights its `init` names (a fresh start only)


class Supervision:
    """One assignment on this worker: prepare, launch, supervise, record the end."""

    def __init__(self, ctx: WorkerContext, c: Claimed):
        self.ctx, self.c = ctx, c
        self.db = ctx.settings.db_url
        # Stored files (earlier attempts' events, the checkpoint to resume from) are read
        # through the storage; the run dir is the local folder this host's trainer writes.
        self.storage = storage_for(ctx.settings)
        self.run_dir = run_dir(ctx.settings, c.job_id)
        # An object store: the run dir is this host's working copy, the worker uploads from
        # it (worker/publish.py), and this host's events file is read from the cache.
        self.remote = not self.storage.stored_run_dirs
        self.events_store: Storage = (
            LocalStorage(ctx.settings.storage) if self.remote else self.storage
        )
        self.uploads = (
            CheckpointUploads(self.storage, ctx.settings.storage, c.job_id) if self.remote else None
        )
        self.shipper: LogShipper | None = None
        self.launched_at = time.monotonic()
        self.events_path = self.run_dir / EVENTS_FILE
        # The log this rank writes here. On an object store each rank has its own (one
        # appender per object), and ranks of one job on one host share the working copy:
        # a shared local file would be shipped, and overwritten, by both.
        self.log_path = self.run_dir / (rank_log_file(c.rank) if self.remote else LOG_FILE)
        self.recorder = EventRecorder(
            c.job_id,
            c.attempt_id,
            c.attempt_number,
            limits=event_limits(ctx.settings),
            uploads=self.uploads,
            measure=None if self.remote else self._measure_checkpoint,
        )
        self._stopping_at: float | None = None  # when this supervisor saw the worker stop
        self.trainer: TrainerHandle | None = None
        self.stop_why: str | None = None
        self.preempted_by: str | None = None  # the job this attempt was stopped for
        self.fenced = False  # the attempt was ended elsewhere: write nothing more
        self.resume_rel: str | None = None
        # A rank other than 0 writes only its error/stopped events, to its own file, from
        # this offset on (what is before it is an earlier attempt's).
        self.rank_events = self.run_dir / rank_events_file(c.rank)
        self.rank_events_start = 0
        self.rungs: Rungs | None = None  # a sweep trial's rungs (worker/rungs.py)
        self.prune_reason: str | None = None
        self.sampler: SystemSampler | None = None  # the trainer's sys/ series (sysmetrics.py)
        self.sys_refused: set[str] = set()  # sys/ names the job's metric rules refused

    def _measure_checkpoint(self, rel: str) -> tuple[str, int]:
        """(sha256, bytes) of a checkpoint (or an artifact) in the local run dir, read by
        descriptor."""
        return beneath.hash_file(self.run_dir, rel)

    def _tx(self, fn: Callable[[Any], T]) -> T:
        with session_scope(self.db) as s:
            out = fn(s)
        self.ctx.store_ok()
        return out

    # ---- before the launch --------------------------------------------------------------

    def _write_spec(self) -> Path:
        return write_spec_file(self.run_dir, self.c.spec)

    def _ingest_backlog(self) -> int:
        """Rank 0: record what earlier attempts' trainers wrote after their supervisor's
        last commit (a worker killed, cut off, or out of store), then return where this
        attempt's own events begin. Those earlier lines are for the record only."""
        events = job_key(self.c.job_id, EVENTS_FILE)
        start = self._tx(lambda s: ingest_start(s, self.c.job_id))
        if self.remote:
            align_events(self.events_path, self.c.attempt_number, start)
        end_torn_line_at(self.events_store, events)
        rec = self.recorder
        # The job's names so far (one more than it may hold tells it is full), shared.
        top = rec.limits.metric_names + 1
        rec.names.update(self._tx(lambda s: metric_names(s, self.c.job_id, limit=top)))
        rec.artifact_names.update(self._tx(lambda s: artifact_names(s, self.c.job_id)))
        backlog = EventRecorder(self.c.job_id, self.c.attempt_id, None, limits=rec.limits,
                                names=rec.names, set_aside=rec.set_aside,
                                artifact_names=rec.artifact_names,
                                uploads=self.uploads, measure=rec.measure)  # fmt: skip
        tail = EventTail.open(self.events_store, events, start, rec.limits.line_bytes)
        n = 0
        try:
            while True:  # in bounded batches, each committed with its offset
                n += backlog.add_all(tail, final=True, limit=TAIL_BATCH)
                self._commit_backlog(backlog)
                self._log_set_aside()
                if tail.drained:
                    break
        finally:
            tail.close()
        if n:
            log.info("job %s: ingested %d events left by earlier attempts", self.c.job_id, n)
        return tail.offset

    def _commit_backlog(self, backlog: EventRecorder) -> None:
        """Commit a backlog batch once its checkpoints are durable in the object store (the
        resume pick must see them): their uploads go on in their thread while this waits,
        through a store outage too. A launch that gave up at once here failed its attempts
        as fast as the scheduler placed them (a chaos run burnt 100 restarts in seconds).
        Gives up (UploadPending: a counted launch failure) after BACKLOG_UPLOAD_WAIT_S or
        when the worker stops; Fenced when the attempt ended meanwhile (a cancel)."""
        deadline = time.monotonic() + BACKLOG_UPLOAD_WAIT_S
        looked = time.monotonic()
        while True:
            try:
                backlog.commit(self._tx)
                return
            except UploadPending:
                now = time.monotonic()
                if now >= deadline or self.ctx.stopping.is_set():
                    raise
            if now - looked >= STATE_POLL_S:
                looked = now
                st = self._tx(lambda s: attempt_status(s, self.c.attempt_id))
                if st.attempt not in ATTEMPT_ACTIVE:
                    raise Fenced(self.c.attempt_id, st.attempt)
            time.sleep(POLL_S)

    def _rendezvous(self, resumed_from: str | None) -> Rendezvous | None:
        """Rank 0 publishes host:port with the checkpoint it resumes from (`resumed_from`);
        the others wait for both (None: gave up). A loopback address for ranks on several
        hosts is refused (BadEndpoint): they would wait in torchrun's rendezvous until it
        timed out."""
        if self.c.world_size == 1:
            return Rendezvous(None, resumed_from)
        if self.c.rank == 0:
            addr, port = self.ctx.advertise_addr, free_port(self.ctx.advertise_addr)
            if is_loopback(addr):
                hosts = self._tx(lambda s: attempt_hosts(s, self.c.attempt_id))
                if len(hosts) > 1:
                    raise BadEndpoint(
                        f"worker {self.ctx.worker_id} advertises the loopback address {addr} "
                        f"to ranks on other hosts ({', '.join(hosts)}): set "
                        "TORCHYARD_ADVERTISE_ADDR (or --advertise-addr) on that worker to an "
                        "address the other hosts reach"
                    )
            endpoint = f"{addr}:{port}"
            self._tx(
                lambda s: set_endpoint(s, self.c.attempt_id, endpoint, resumed_from=resumed_from)
            )
            return Rendezvous((addr, port), resumed_from)
        deadline = time.monotonic() + self.ctx.settings.rendezvous_timeout_s
        while time.monotonic() < deadline and not self.ctx.stopping.is_set():
            got = self._tx(lambda s: read_endpoint(s, self.c.attempt_id))
            if got.state not in ATTEMPT_ACTIVE:
                raise Fenced(self.c.attempt_id, got.state)
            if got.endpoint:
                host, _, published = got.endpoint.rpartition(":")
                return Rendezvous((host, int(published)), got.resumed_from)
            time.sleep(0.2)
        return None

    def _resume_path(self, rel: str | None) -> Path | None:
        """The checkpoint rank 0 picked (relative to the run dir), as a file on this host
        (fetched from the storage where it is not a local one), its recorded sha256
        checked before the trainer loads it."""
        if rel is None:
            return None
        sha = self._tx(lambda s: recorded_sha256(s, self.c.job_id, rel)) or ""
        try:
            key = self.storage.recorded_file_key(self.c.job_id, rel, sha)
            return self.storage.local_copy(key, sha256=sha or None)
        except ChecksumMismatch as e:
            raise StorageNotShared(
                f"rank {self.c.rank} on worker {self.ctx.worker_id}: the checkpoint {rel} "
                f"does not match its recorded sha256 ({e})"
            ) from None
        except (UnsafePath, FileNotFoundError):
            raise StorageNotShared(
                f"rank 0 resumes from {rel}, which worker {self.ctx.worker_id} cannot read "
                f"from {self.storage.describe(job_key(self.c.job_id, rel))}: every worker "
                "must see the same storage (TORCHYARD_STORAGE_URL or TORCHYARD_STORAGE_ROOT)"
            ) from None

    def _log_line(self, text: str) -> None:
        """A marker in the job log. Best effort: a full disk must not wedge the worker."""
        try:
            append_to_log(self.log_path, text)
        except OSError as e:
            log.warning("job %s: could not write to the job log (%s)", self.c.job_id, e)

    def launch(self, p: Prepared) -> None:
        if self.remote:  # before the first line of this attempt's log
            key = log_key_for_rank(self.c.job_id, self.c.rank)
            self.shipper = LogShipper(self.storage, self.log_path, key)
        try:  # an older release gave the log to the sandbox's user: the worker's own again
            claim_log(self.log_path)
        except OSError as e:
            log.warning("job %s: could not claim the job log (%s)", self.c.job_id, e)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        how = f"resuming from {self.resume_rel}" if self.resume_rel else "fresh start"
        self._log_line(
            f"===== torchyard: attempt {self.c.attempt_number}, rank {self.c.rank}/"
            f"{self.c.world_size}, worker {self.ctx.worker_id}, {now}, {how} =====\n"
        )
        request = self._request(p)
        self.launched_at = time.monotonic()
        self.ctx.lease_gap = 0.0
        self.tail = EventTail(self.events_path, p.events_start)
        self.recorder.offset = p.events_start
        if self.c.rank != 0:
            self.rank_events_start = file_size(self.rank_events)
        self.trainer = trainer = self.ctx.trainer_launcher().start(request)
        self.ctx.trainer = trainer
        self.ctx.metrics.trainer_started(self.c.attempt_number)
        if self.ctx.on_launch is not None:
            self.ctx.on_launch(trainer.pid)
        pid = trainer.pid
        retry_until(
            "recording the trainer pid",
            lambda: self._tx(
                lambda s: mark_launched(s, self.c.assignment_id, pid, resumed_from=self.resume_rel)
            ),
            give_up=lambda: trainer.poll() is not None,
        )
        log.info(
            "job %s attempt %d rank %d: trainer pid %d",
            self.c.job_id,
            self.c.attempt_number,
            self.c.rank,
            pid,
        )

    def _request(self, p: Prepared) -> LaunchRequest:
        """What the launcher starts: this rank's argv and environment on this slot."""
        master = p.master
        launch = Launch(
            spec_path=p.spec_path,
            run_dir=self.run_dir,
            resume=p.resume,
            world_size=self.c.world_size,
            rank=self.c.rank,
            master_addr=master[0] if master else None,
            master_port=master[1] if master else None,
            code_dir=p.code_dir,
            init=p.init,
        )
        env = slot_env(
            self.ctx.settings,
            self.ctx.device.cuda_visible,
            self.ctx.extra_env,
            self.c.attempt_number,
        )
        return LaunchRequest(
            launch=launch,
            argv=trainer_argv(launch),
            env=env,
            cwd=self.run_dir,
            log_path=self.log_path,
            warm_ok=launch.world_size == 1,
            max_log_bytes=self.ctx.settings.max_log_bytes,
            runs_code=runs_code(self.c.spec),
            tenant=self.c.owner_id,
            sandbox_uid=sandbox_uid(self.ctx.settings, self.c.owner_id),
        )

    # ---- supervision --------------------------------------------------------------------

    def _flush(self) -> None:
        """Write the buffered events (fenced); on a store error they stay buffered."""
        if self.fenced or not self.recorder.pending:
            return
        try:
            self.recorder.commit(self._tx)
        except Fenced:
            self._fence_hit()
        except UploadPending:
            pass  # the batch waits for its checkpoints' upload; the trainer runs on
        except Exception as e:
            log.warning("event flush failed (%s); kept, will retry", e)
        self._log_set_aside()

    def _log_set_aside(self) -> None:
        """What the recorder set aside since the last look, into the job log."""
        for line in self.recorder.set_aside.take_log_lines():
            self._log_line(line)

    def _fence_hit(self) -> None:
        """Someone else ended this attempt (the reaper, another rank): the job may already
        run elsewhere, so this trainer must not write another byte."""
        self.fenced = True
        if self.trainer is not None and self.trainer.poll() is None:
            self._stop("attempt ended elsewhere", signal.SIGKILL, None)

    def _poll_store(self) -> AttemptStatus:
        return self._tx(lambda s: attempt_status(s, self.c.attempt_id))

    def _stop(self, why: str, sig: int, grace_s: float | None) -> float | None:
        """SIGKILL to the trainer's whole group, or SIGTERM to its leader only (one, so that
        it checkpoints: worker/launcher.py TrainerHandle.terminate); the kill time."""
        assert self.trainer is not None
        log.info(
            "job %s: %s -> sending %s to the trainer", self.c.job_id, why, signal.Signals(sig).name
        )
        if sig == signal.SIGKILL:
            self.trainer.kill()
        else:
            self.trainer.terminate()
        return None if grace_s is None else time.monotonic() + grace_s

    def _check_store(self) -> float | None:
        """Poll the job and attempt state; act on a cancel or an attempt ended elsewhere."""
        try:
            st = self._poll_store()
        except Exception as e:
            log.warning("store poll failed (%s)", e)
            return None
        grace = self.ctx.settings.cancel_grace_s
        if st.attempt not in ATTEMPT_ACTIVE:
            self._fence_hit()
        elif st.job == CANCELLING:
            self.stop_why = STOP_CANCEL
            return self._stop("cancel requested", signal.SIGTERM, grace)
        elif st.preempted_by is not None:
            # Like a cancel, but the job goes back to the queue and resumes from the
            # checkpoint the trainer writes on SIGTERM.
            self.stop_why, self.preempted_by = STOP_PREEMPT, st.preempted_by
            return self._stop(f"preempted by job {st.preempted_by}", signal.SIGTERM, grace)
        return None

    def supervise(self) -> int:
        trainer = self.trainer
        assert trainer is not None
        rank0 = self.c.rank == 0
        kill_at: float | None = None
        last_poll = last_flush = time.monotonic()
        self.tail.max_line = self.recorder.limits.line_bytes
        self.ctx.run_dir_full, self.ctx.low_space_at = None, None
        self.ctx.watch_dir = self.run_dir  # the watchdog measures it from now on
        self._start_sampler(trainer.pid)
        while True:
            now = time.monotonic()
            self.ctx.loop_beat = now
            rc = trainer.poll()
            last_flush = self._take_samples(now, last_flush, rank0)
            if rank0:
                last_flush, pruned_at = self._take_events(now, last_flush)
                kill_at = pruned_at if pruned_at is not None else kill_at
            if rc is not None:
                break
            if self.stop_why is None and not self.fenced and now - last_poll >= STATE_POLL_S:
                last_poll = now
                kill_at = self._check_store()
            if self.stop_why is None and self.ctx.store_lost_stop.is_set():
                self.stop_why = STOP_STORE_LOST  # the watchdog signals the trainer itself
            if self.stop_why is None and not self.fenced and self.ctx.stopping.is_set():
                grace = max(self.ctx.settings.cancel_grace_s, STOP_GRACE_MIN_S)
                grace = min(grace, STOP_DEADLINE_S - 5)  # its end recorded within the deadline
                self._stopping_at = self._stopping_at or now
                kill_at = self._stop("worker stopping", signal.SIGTERM, grace)
                self.stop_why = STOP_WORKER
            if kill_at is not None and now >= kill_at:
                log.warning(
                    "job %s: trainer still alive after the grace period; SIGKILL", self.c.job_id
                )
                trainer.kill()
                kill_at = None
            time.sleep(POLL_S)
        self.ctx.loop_beat = None
        # Whatever the trainer left in its group (torchrun ranks, loader workers) goes too.
        trainer.kill()
        self.ctx.watch_dir = None
        self._stop_sampler(rank0)
        if rank0:
            try:
                self._retry_drain()
            finally:
                self.tail.close()
        return rc

    def _start_sampler(self, pid: int) -> None:
        """The trainer's system metrics, sampled in a thread (TORCHYARD_SYS_METRICS_INTERVAL_S;
        0: none)."""
        interval = self.ctx.settings.sys_metrics_interval_s
        if interval > 0:
            gpu, rank, job = self.ctx.device.cuda_visible, self.c.rank, self.c.job_id
            sampler = SystemSampler(pid=pid, rank=rank, gpu=gpu, interval_s=interval, job_id=job)
            self.sampler = sampler.start()

    def _take_samples(self, now: float, last_flush: float, rank0: bool) -> float:
        """Each poll: the sampler's rows into the recorder's batch (rank 0 flushes them with
        the trainer's events; another rank, which has no events, on the same cadence) and
        its notes into the job log. Returns when it last flushed."""
        if self.sampler is None:
            return last_flush
        for line in self.sampler.take_notes():
            self._log_line(line)
        for line in record_samples(self.recorder, self.sampler.take(), self.sys_refused):
            self._log_line(line)
        if not rank0 and self.recorder.pending and now - last_flush >= FLUSH_S:
            self._flush()
            return now
        return last_flush

    def _stop_sampler(self, rank0: bool) -> None:
        """The trainer has ended: its last samples into the batch (rank 0's drain writes them;
        another rank tries once: they are not worth holding the attempt's end for)."""
        if self.sampler is None:
            return
        self.sampler.stop()
        self._take_samples(time.monotonic(), -math.inf, rank0)
        self.sampler = None

    def _take_events(self, now: float, last_flush: float) -> tuple[float, float | None]:
        """Rank 0, each poll: read the trainer's new events, answer a rung, flush when due.
        Returns (when it last flushed, the kill time of a trial just pruned or None).

        While an upload holds the batch, later events wait in the events file: read, a
        newer checkpoint would supersede the one going up, and a trainer that checkpoints
        faster than the store takes them would keep every batch (its metrics and progress
        too) waiting until it ends. The held batch is retried every poll, so it commits as
        soon as its checkpoint is durable."""
        rec, pruned_at = self.recorder, None
        waiting = rec.waiting_upload
        if not waiting:
            rec.add_all(self.tail, limit=TAIL_BATCH)
        if rec.rungs:
            pruned_at = self._at_rungs()
        due = waiting or now - last_flush >= FLUSH_S or rec.pending >= FLUSH_EVENTS
        if rec.pending and due:
            self._flush()
            last_flush = now
        return last_flush, pruned_at

    def _flush_or_raise(self) -> None:
        try:
            self.recorder.commit(self._tx)
        except Fenced:
            self.fenced = True
        self._log_set_aside()

    def _past_stop_deadline(self) -> bool:
        """The worker is stopping and STOP_DEADLINE_S have passed since this supervisor
        first saw it: store writes are given up (what is unwritten stays in events.jsonl
        past the committed offset, for the next supervisor; the reaper ends the attempt)."""
        if not self.ctx.stopping.is_set():
            return False
        if self._stopping_at is None:
            self._stopping_at = time.monotonic()
        return time.monotonic() - self._stopping_at > STOP_DEADLINE_S

    def _drain(self) -> None:
        """Rank 0, after its trainer's exit: every line it left, in bounded batches."""
        while not self.fenced:
            self.recorder.add_all(self.tail, final=True, limit=TAIL_BATCH)
            retry_until(
                "recording the trainer's last events",
                self._flush_or_raise,
                give_up=self._past_stop_deadline,
            )
            if self.tail.drained:
                break

    def _retry_drain(self) -> None:
        try:
            self._drain()
        except TRANSIENT as e:
            if not self._past_stop_deadline():
                raise
            log.warning(
                "job %s: worker stopping; its trainer's last events stay unrecorded (%s): "
                "the next attempt ingests them",
                self.c.job_id,
                e,
            )

    # ---- the end ------------------------------------------------------------------------

    def _ending(self, rc: int) -> Decision | None:
        o = self.recorder.outcome
        if self.fenced:
            return None
        try:
            job_state, att_state, _ = retry_until(
                "reading the job state", self._poll_store, give_up=self._past_stop_deadline
            )
        except TRANSIENT:
            if not self._past_stop_deadline():
                raise
            return None  # the store is out of reach past the stop deadline: the reaper's
        if att_state not in ATTEMPT_ACTIVE:
            return None
        if self.ctx.store_lost_stop.is_set() and self.stop_why is None:
            self.stop_why = STOP_STORE_LOST
        oom_killed = self.trainer is not None and self.trainer.oom_killed()
        error, stopped = o.error, o.stopped is not None
        if self.c.rank != 0:  # this rank's own report (rank 0's are in the recorder)
            mine = last_rank_event(self.rank_events, self.rank_events_start, self.c.attempt_number)
            if mine is not None and mine.get("type") == "error":
                error = mine
            stopped = stopped or (mine is not None and mine.get("type") == "stopped")
        if stopped and self.stop_why is None and self.ctx.stopping.is_set():
            # The stop signal reached the trainer too, maybe first (Slurm signals every
            # process of a job): still this worker's hand-back, not the trainer's doing.
            self.stop_why = STOP_WORKER
        ending = Ending(
            rc=rc,
            rank=self.c.rank,
            worker_id=self.ctx.worker_id,
            stop_why=self.stop_why,
            job_state=job_state,
            finished=o.finished,
            error=error,
            stopped=stopped,
            last_step=o.last_step,
            oom_killed=oom_killed,
            preempted_by=self.preempted_by,
            lease_lapsed=self.ctx.lease_lapsed_since(self.launched_at, self._lease_stop_s()),
            prune_reason=self.prune_reason,
        )
        decision = decide(self._with_evidence(ending))
        if (
            decision is not None
            and self.stop_why is None
            and peer_decides_first(ending, decision, self.c.world_size)
        ):
            # Another rank has the real cause (a rank whose peer died reports only that;
            # a rank that left no report of its own defers to rank 0; a rank stopped with
            # its gang defers to the worker that stopped it): let it decide first.
            deadline = time.monotonic() + PEER_DECIDES_S
            while time.monotonic() < deadline:
                if self._poll_store()[1] not in ATTEMPT_ACTIVE:
                    return None
                time.sleep(0.2)
        return decision

    def _with_evidence(self, e: Ending) -> Ending:
        """The ending with what the worker itself found in the run directory: over its size
        limit (the watchdog's look, or one now), and, where the trainer blames the storage,
        whether the file system is full."""
        limit = self.ctx.settings.max_run_dir_bytes
        over = self.ctx.run_dir_full or run_dir_over(self.run_dir, limit)
        evidence, seen = None, "room"
        if e.claims_storage_full():
            evidence = storage_evidence(self.run_dir, self.ctx.low_space_at)
            seen = free_description(self.run_dir)
        return replace(e, run_dir_full=over, storage_evidence=evidence, storage_seen=seen)

    def finish(self, rc: int | None, decision: Decision | None) -> str | None:
        summary = self.recorder.set_aside.summary()
        if decision is not None and summary is not None:
            decision = decision._replace(reason=f"{decision.reason}; {summary}")

        def tx(s: Any) -> str | None:
            end_assignment(s, self.c.assignment_id, rc)
            if decision is None:
                return None
            return finish_attempt(
                s,
                self.c.attempt_id,
                decision.outcome,
                exit_code=rc,
                reason=decision.reason,
                error=decision.error,
                retryable=decision.retryable,
            )

        try:
            state = retry_until(
                "recording the attempt's end",
                lambda: self._tx(tx),
                give_up=self._past_stop_deadline,
            )
        except TRANSIENT as e:
            if not self._past_stop_deadline():
                raise
            log.warning(
                "job %s: worker stopping and the store out of reach (%s): the attempt's end "
                "is left to the reaper",
                self.c.job_id,
                e,
            )
            return None
        if decision is not None:
            self.ctx.metrics.attempt_ended(decision.outcome)
            log.info(
                "job %s attempt %d rank %d: %s (%s) -> job %s",
                self.c.job_id,
                self.c.attempt_number,
                self.c.rank,
                decision.outcome,
                decision.reason,
                state,
            )
        return state

    def _prepare(self) -> Prepared | Decision:
        """Everything before the launch; a Decision when the attempt ends here. Rank 0
        records what earlier attempts left and picks the checkpoint to resume from; the
        other ranks take that pick at the rendezvous, never one of their own."""
        spec_path = self._write_spec()
        self.rungs = self._prepare_rungs()
        start, picked = 0, None
        if self.c.rank == 0:
            start = self._ingest_backlog()  # may record the last checkpoint: look after it
            picked = self._tx(lambda s: resume_pick(s, self.c.job_id, self.storage))
        code = code_dir(self.ctx.settings, self.c.spec)
        data_ready(self.ctx.settings, self.c.spec)
        rdv = self._rendezvous(picked)
        if rdv is None:
            if self.ctx.stopping.is_set():
                return Decision(A_HANDED_BACK, f"worker {self.ctx.worker_id} stopping", None, False)
            t = self.ctx.settings.rendezvous_timeout_s
            return Decision(
                A_LOST, f"rendezvous: rank 0's endpoint not published within {t:g}s", None, True
            )
        self.resume_rel = rdv.resumed_from
        resume, init = self._resume_path(rdv.resumed_from), None
        if resume is None and (row := self._tx(lambda s: init_source(s, self.c.spec))) is not None:
            init = init_file(self.ctx.settings, row)
        return Prepared(spec_path, resume, rdv.master, start, code, init)

    def _prepare_rungs(self) -> Rungs | None:
        c = self.c
        if c.sweep_pruner and self.ctx.pruning is None:
            self.ctx.pruning = Pruning(self.db)
        return prepare_rungs(self.ctx.pruning, self.run_dir, c.job_id, c.sweep_metric,
                             c.sweep_pruner, self._tx)  # fmt: skip

    def _at_rungs(self) -> float | None:
        """Rank 0's trainer waits at a rung: its metrics into the store, then the pruner's
        verdict to the trainer. A pruned trial's trainer exits at once; one that does not
        is killed after PRUNE_GRACE_S (returned: the kill time)."""
        pending = self.recorder.rungs
        if self.rungs is None or self.stop_why is not None or self.fenced:
            pending.clear()
            return None
        self._flush()
        done = self.rungs.answer(pending)
        if done is None:
            return None
        if done.verdict.pause:
            # As for a preemption: the waiting trainer checkpoints at the rung on SIGTERM and
            # the job is handed back, held until the sweep's controller decides.
            self.stop_why = STOP_PAUSED
            self.prune_reason = f"{PAUSED_AT}{done.step}: {done.verdict.reason}"
            grace = self.ctx.settings.cancel_grace_s
            return self._stop(self.prune_reason, signal.SIGTERM, grace)
        self.stop_why = STOP_PRUNED
        self.prune_reason = f"pruned at step {done.step}: {done.verdict.reason}"
        log.info("job %s: %s", self.c.job_id, self.prune_reason)
        return time.monotonic() + PRUNE_GRACE_S

    def _lease_stop_s(self) -> float:
        """How stale the trainer's lease gets before it stops itself (no lease: never)."""
        raw = self.ctx.extra_env.get("TORCHYARD_LEASE_STOP_S")
        return float(raw) if raw else math.inf

    def _launch_failed(self, e: Exception) -> Decision:
        if isinstance(e, InputError | SandboxRefused):  # the same next time
            return Decision(A_FAILED, str(e), str(e), False)
        if isinstance(e, BadEndpoint | StorageNotShared):  # the workers' setup: counted, retried
            return Decision(A_FAILED, str(e), str(e), True)
        why = f"launch failed on worker {self.ctx.worker_id}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # The storage, not the job: hand it back (not counted) to retry when there is room.
            return Decision(A_HANDED_BACK, f"storage full: {why}", None, False)
        return Decision(A_FAILED, why, None, True)

    def run(self) -> None:
        try:
            self._run()
        finally:
            if self.shipper is not None:
                self.shipper.close()
            if self.uploads is not None:
                self.uploads.close()

    def _run(self) -> None:
        if self.c.cancelling:
            self.finish(None, Decision(A_CANCELLED, "cancelled before it started", None, False))
            return
        self.ctx.store_lost_stop.clear()
        try:
            prepared = self._prepare()
            if isinstance(prepared, Decision):
                self.finish(None, prepared)
                return
            self.launch(prepared)
        except Fenced:
            # The attempt was ended elsewhere (a peer rank's failed launch, the reaper) while
            # this rank launched: its trainer, if it started, is no attempt's. Left running,
            # a rank waits for a rendezvous that never comes, on a worker counted idle (the
            # chaos soak found such sandboxes).
            self._kill_trainer()
            self.finish(None, None)
            return
        except Exception as e:
            log.exception("job %s: launch failed", self.c.job_id)
            self._kill_trainer()
            self.finish(None, self._launch_failed(e))
            return
        try:
            rc = self.supervise()
        except BaseException:
            # Never leave a trainer behind an exception in the worker.
            if self.trainer is not None:
                self.trainer.kill()
            raise
        finally:
            self.ctx.trainer = None
            if self.sampler is not None:
                self.sampler.stop()
        self._log_line(
            f"===== torchyard: attempt {self.c.attempt_number}, rank {self.c.rank}: "
            f"trainer {describe_exit(rc)} =====\n"
        )
        if self.shipper is not None:  # the log complete in the store before the job ends
            self.shipper.close()
            self.shipper = None
        self.finish(rc, self._unstored(self._ending(rc)))

    def _kill_trainer(self) -> None:
        """The trainer a failed or fenced launch started, if any: killed and reaped."""
        if self.trainer is not None:
            log.warning("job %s: stopping the trainer this launch started (pid %d)",
                        self.c.job_id, self.trainer.pid)  # fmt: skip
            self.trainer.kill()
            self.trainer.wait()

    def _unstored(self, d: Decision | None) -> Decision | None:
        """A success whose checkpoints (its final weights) are still unrecorded, because
        the object store stayed out of reach past the worker's stop deadline, is not one:
        handed back, the next attempt resumes from what is stored."""
        if d is None or d.outcome != A_SUCCEEDED or not self.recorder.checkpoints:
            return d
        why = f"the final weights are not stored yet ({d.reason})"
        return Decision(A_HANDED_BACK, why, None, False)


# ---- errors and rules --------------------------------------------------------------------


class BadEndpoint(RuntimeError):
    """Rank 0's rendezvous address cannot work for this attempt's hosts."""


class StorageNotShared(RuntimeError):
    """A rank cannot read the checkpoint rank 0 resumes from."""


def peer_decides_first(e: Ending, d: Decision, world_size: int) -> bool:
    """Whether this rank should wait for another rank's worker to end the attempt: its
    trainer failed because a peer did (`peer_failed`), it is a rank other than 0 that
    failed without a report of its own, or it stopped at a checkpoint nobody here asked for
    while it has peers (every rank stops together when one rank's worker stops its trainer:
    that worker has the cause, a scancel or a SIGTERM of that host, and hands the job back)."""
    if d.outcome not in (A_LOST, A_FAILED):
        return False
    kind = (e.error or {}).get("kind")
    if e.stopped and e.stop_why is None and kind is None and world_size > 1:
        return True
    return kind == "peer_failed" or (e.rank != 0 and kind is None)


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
        sup = Supervision(ctx, c)
        with ctx.metrics.supervising(sup):
            sup.run()
    finally:
        ctx.current_assignment = None
    return True
