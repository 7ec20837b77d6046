"""The worker process: one Celery worker (solo pool, concurrency 1, prefetch 1) on its
own queue, registered in the store with a heartbeat thread.

Why the solo pool: the task runs in the main process's main thread, so (a) there is no
forked pool child at all, (b) the trainer is started from a thread that lives as long as
the worker, which is what the parent-death signal follows, and (c) Celery's warm
shutdown on SIGTERM lets the running task finish: the task sees `stopping`, has the
trainer checkpoint and exit, hands the job back, and only then does the worker exit.

The slot's warm trainer (worker/standby.py, unless TORCHYARD_WARM_TRAINER=false) is
started on that same main thread: before the consumer starts, and again after each job.
Whether it is ready (`workers.warm_since`, which placement prefers: scheduler/policy.py)
rides on every heartbeat and release; the heartbeat thread writes it at once, between
heartbeats, when it changes (ready, taken, died), so the scheduler sees it within
HB_POLL_S. A worker without one, or whose launcher starts every trainer cold, is never warm.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import IO, Any

from torchyard.broker.app import (
    REGISTER_TASK,
    RUN_TASK,
    make_celery,
    make_consumer,
    wake_scheduler,
    worker_queue,
)
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.workers import (
    LOST,
    WorkerInfo,
    deregister,
    heartbeat,
    register_worker,
    release_worker,
    set_warm,
    stop_accepting,
)
from torchyard.worker.identity import Device
from torchyard.worker.launcher import choose_launcher, uses_standby
from torchyard.worker.proc import slot_env
from torchyard.worker.sandbox import say_sandbox
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.supervisor import WorkerContext, retry_until, run_assignment
from torchyard.worker.watchdog import Watchdog

log = logging.getLogger(__name__)

HB_POLL_S = 0.2
REREGISTER_EVERY_S = 5.0


class WorkerNode:
    def __init__(
        self,
        settings: Settings,
        worker_id: str,
        device: Device,
        advertise_addr: str,
        lock: IO[str] | None = None,
    ):
        self.settings = settings
        self.queue = worker_queue(settings, worker_id)
        self.ctx = WorkerContext(settings, worker_id, device, advertise_addr)
        self._lock = lock  # held for the process's life: this slot is ours
        self._hb_stop = threading.Event()
        self._stop_marked = False
        self.watchdog = Watchdog(self.ctx)
        self.ctx.extra_env = self.watchdog.lease_env()
        if settings.warm_trainer:
            self.ctx.warm = WarmTrainer(
                lambda: slot_env(settings, device.cuda_visible, self.ctx.extra_env),
                max_log_bytes=settings.max_log_bytes,
            )
        # Made before the standby starts: the launcher decides how (inside the sandbox).
        self.ctx.launcher = choose_launcher(settings, self.ctx.warm)
        self._uses_standby = uses_standby(self.ctx.launcher)
        self._warm_told: bool | None = None  # the warm mark the store was last sent
        self._next_beat = 0.0
        say_sandbox(settings)
        self.app = make_celery(settings)
        self._asked_register_at = -REREGISTER_EVERY_S
        self._store_state = "starting"  # as the store last told it: starting, idle or lost
        self.ctx.metrics.state_of = self.state_name
        gpu = "" if device.gpu is None else str(device.gpu)
        self.ctx.metrics.identity = {"worker": worker_id, "device": device.kind, "gpu": gpu}

    def state_name(self) -> str:
        """The state the worker's metrics show (worker/metrics.py STATES)."""
        if self.ctx.stopping.is_set():
            return "stopping"
        if self.ctx.current_assignment is not None:
            return "busy"
        return self._store_state

    @property
    def worker_id(self) -> str:
        return self.ctx.worker_id

    def info(self) -> WorkerInfo:
        d = self.ctx.device
        return WorkerInfo(
            id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            queue=self.queue,
            device=d.kind,
            gpu=d.gpu,
            device_name=d.name,
            memory_bytes=d.memory_bytes,
            warm=self.warm_now(),
        )

    def warm_now(self) -> bool:
        """Whether this slot's next one-rank job would start on a ready standby."""
        warm = self.ctx.warm
        return (
            warm is not None
            and self._uses_standby
            and not self.ctx.stopping.is_set()
            and warm.ready()
        )

    def register(self) -> None:
        info = self.info()
        with session_scope(self.settings.db_url) as s:
            lost = register_worker(s, info)
        self._warm_told = info.warm
        self._store_state = "idle"
        self.ctx.store_ok()
        if lost:
            log.warning("previous process of %s left jobs %s; marked lost", self.worker_id, lost)
        log.info("worker %s registered (queue %s)", self.worker_id, self.queue)
        wake_scheduler(self.settings)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(HB_POLL_S):
            try:
                self.heartbeat_tick()
            except Exception as e:
                log.warning("heartbeat failed (%s)", e)

    def heartbeat_tick(self) -> None:
        """One poll of the heartbeat thread: the stop mark, then the heartbeat when due,
        else the warm mark if it changed."""
        if self.ctx.stopping.is_set() and not self._stop_marked:
            # Outside the signal handler: take no new work from now on.
            with session_scope(self.settings.db_url) as s:
                stop_accepting(s, self.worker_id)
            self._stop_marked = True
        if time.monotonic() < self._next_beat:
            self._tell_warm()
            return
        self._next_beat = time.monotonic() + self.settings.heartbeat_interval_s
        if self.watchdog.loop_stalled(time.monotonic()):
            # The supervision loop is stuck: stop vouching, so the reaper takes over.
            log.warning("worker %s: supervision loop stalled; no heartbeat", self.worker_id)
            return
        warm = self._warm_told = self.warm_now()
        with session_scope(self.settings.db_url) as s:
            state = heartbeat(s, self.worker_id, warm)
        self.ctx.store_ok()
        self._store_state = "lost" if state in (LOST, None) else "idle"
        if (
            state in (LOST, None)
            and self.ctx.current_assignment is None
            and not self.ctx.stopping.is_set()
        ):
            self._ask_register(state)

    def _tell_warm(self) -> None:
        """The standby became ready, or was taken or died, since the store was last told:
        one small UPDATE now rather than a heartbeat later. Marked told before the write:
        a store out of reach hears it with the next heartbeat, not a retry every poll."""
        warm = self.warm_now()
        if warm == self._warm_told:
            return
        self._warm_told = warm
        with session_scope(self.settings.db_url) as s:
            set_warm(s, self.worker_id, warm)

    def _ask_register(self, state: str | None) -> None:
        """Declared lost while alive (a long stall, a missed claim deadline): come back as
        a fresh worker, but through our own queue, so only a working consumer returns."""
        now = time.monotonic()
        if now - self._asked_register_at < REREGISTER_EVERY_S:
            return
        self._asked_register_at = now
        log.warning("worker %s was marked %s; asking to register again", self.worker_id, state)
        self.app.send_task(
            REGISTER_TASK, args=[], queue=self.queue, retry=False, ignore_result=True
        )

    def _register_task(self) -> None:
        with session_scope(self.settings.db_url) as s:
            state = heartbeat(s, self.worker_id)
        if state in (LOST, None) and not self.ctx.stopping.is_set():
            self.register()

    def _on_shutdown(self, **_: Any) -> None:
        # Called inside Celery's signal handler: only set a flag.
        self.ctx.stopping.set()

    def _task(self, assignment_id: int) -> None:
        aid = int(assignment_id)
        if self.ctx.stopping.is_set():
            # Taken off the queue after the stop began: give it back untouched.
            with session_scope(self.settings.db_url) as s:
                deregister(s, self.worker_id)
            wake_scheduler(self.settings)
            return
        started = False
        try:
            started = run_assignment(self.ctx, aid)
        finally:
            if self.ctx.warm is not None and not self.ctx.stopping.is_set():
                # The trainer is gone: its cores are free for the import. First, so that
                # a zygote taken back (worker/zygote.py) is the standby the kill spares.
                self.ctx.warm.refill()
            self._end_stragglers()
            if started:
                try:
                    with session_scope(self.settings.db_url) as s:
                        if self.ctx.stopping.is_set():
                            # Never idle again: the scheduler must not hand it a new job.
                            deregister(s, self.worker_id)
                        else:
                            # Usually cold: the next standby has only just started.
                            self._warm_told = warm = self.warm_now()
                            release_worker(s, self.worker_id, aid, warm)
                except Exception as e:  # the scheduler's reconciler frees it later
                    log.warning("could not release worker %s (%s)", self.worker_id, e)
                wake_scheduler(self.settings)

    def _end_stragglers(self) -> None:
        """What the job's trainer left in the slot's cgroup (a daemonised child) ends with
        its job; an idle standby (its own process group) is spared."""
        cgroup = getattr(self.ctx.launcher, "cgroup", None)
        if cgroup is not None:
            warm = self.ctx.warm.proc if self.ctx.warm is not None else None
            cgroup.kill_all(spare_groups=(warm.pid,) if warm is not None else ())

    def run(self) -> int:
        from celery import signals

        if self.ctx.warm is not None:
            self.ctx.warm.refill()  # here, on the main thread the tasks run on
        # A worker started while the database is out of reach (a host booting during an
        # outage) waits for it, saying so, rather than exiting.
        retry_until(f"registering worker {self.worker_id}", self.register)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self.watchdog.start()
        app = self.app
        app.conf.worker_enable_remote_control = False
        app.conf.worker_redirect_stdouts = False
        app.task(name=RUN_TASK, acks_late=True, ignore_result=True)(self._task)
        app.task(name=REGISTER_TASK, ignore_result=True)(self._register_task)
        signals.worker_shutting_down.connect(self._on_shutdown, weak=False)
        w = make_consumer(app, name=self.worker_id, queue=self.queue)
        try:
            w.start()
        finally:
            self.ctx.stopping.set()
            if self.ctx.warm is not None:
                self.ctx.warm.close()
            if (cgroup := getattr(self.ctx.launcher, "cgroup", None)) is not None:
                cgroup.close()
            self._hb_stop.set()
            hb.join(timeout=5)
            self.watchdog.stop()
            try:
                with session_scope(self.settings.db_url) as s:
                    deregister(s, self.worker_id)
                log.info("worker %s deregistered", self.worker_id)
            except Exception as e:
                log.warning("could not deregister %s (%s)", self.worker_id, e)
            wake_scheduler(self.settings)
        return int(w.exitcode or 0)
