"""The scheduler process (`torchyard scheduler`, scheduler/cli.py): a Celery consumer of
the control queue (SCHEDULE_TASK wake-ups from the API and the workers) plus a periodic
tick that runs the reaper, the reconciler (lost messages re-sent, the claim deadline), the
sweep controller and a scheduling pass, so that a lost wake-up or a lost assignment
message only costs a tick. The store is the truth; the broker only wakes things up."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from torchyard.broker.app import (
    RUN_TASK,
    SCHEDULE_TASK,
    control_queue,
    make_celery,
    make_consumer,
)
from torchyard.scheduler.cycle import (
    MAX_RANKS_PER_PASS,
    Dispatch,
    PoolPolicy,
    resend_due,
    run_pass,
)
from torchyard.scheduler.metrics import SchedulerMetrics
from torchyard.scheduler.notify import Notifier
from torchyard.scheduler.policy import RESERVE_AFTER_S
from torchyard.scheduler.sweeps import SweepController
from torchyard.settings import Settings
from torchyard.store.attempts import abandon_assignments_of_gone_workers, unclaimed_assignments
from torchyard.store.bundles import remove_unused_bundles_due
from torchyard.store.db import session_scope
from torchyard.store.models import utcnow
from torchyard.store.workers import (
    expire_unclaimed,
    lose_unsupervised_attempts,
    reap_stale_workers,
    release_orphaned_workers,
)

log = logging.getLogger(__name__)

TICK_S = 2.0
RESEND_AFTER_S = 3.0  # an assignment unclaimed this long may have lost its message
RESEND_EVERY_S = 5.0  # then again at most this often (duplicates are harmless: the lease)


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        *,
        tick_s: float = TICK_S,
        reserve_after_s: float = RESERVE_AFTER_S,
        max_ranks: int = MAX_RANKS_PER_PASS,
    ):
        self.settings = settings
        self.max_ranks = max_ranks
        self.tick_s = tick_s
        self.reserve_after_s = reserve_after_s
        self.app = make_celery(settings)
        self.app.conf.worker_enable_remote_control = False
        self.app.conf.worker_redirect_stdouts = False
        self._lock = threading.Lock()  # the wake-up task and the tick never overlap here
        self._stop = threading.Event()
        self._last_sent: dict[int, datetime] = {}
        # monotonic time since which every store call of the tick succeeded (None: failing)
        self._store_ok_since: float | None = None
        self.sweeps = SweepController(settings)
        # The webhook sender (scheduler/notify.py): its own thread, woken with the passes.
        self.notifier = Notifier(settings)
        self.metrics = SchedulerMetrics(settings.db_url)  # served only with a metrics port

    def _send(self, assignment_id: int, queue: str) -> bool:
        try:
            self.app.send_task(
                RUN_TASK, args=[assignment_id], queue=queue, retry=False, ignore_result=True
            )
            return True
        except Exception as e:  # the reconciler re-sends it
            log.warning("could not send assignment %d to %s (%s)", assignment_id, queue, e)
            return False

    def schedule_pass(self, why: str = "tick") -> list[Dispatch]:
        """Passes until one places all it can: each is bounded (MAX_RANKS_PER_PASS), and
        its messages go out as soon as it commits, before the next pass runs."""
        sent: list[Dispatch] = []
        with self._lock:
            more = True
            while more:
                started = time.monotonic()
                with session_scope(self.settings.db_url) as s:
                    out, more = run_pass(
                        s,
                        heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
                        reserve_after_s=self.reserve_after_s,
                        pool=PoolPolicy(
                            self.settings.preempt_after_s, self.settings.fairshare_half_life_s
                        ),
                        max_ranks=self.max_ranks,
                    )
                # After the commit: a worker must find its assignment when the message
                # arrives.
                for d in out:
                    self._send(d.assignment_id, d.queue)
                    self.metrics.dispatched(started)
                    log.info(
                        "job %s rank %d -> %s (assignment %d, %s)",
                        d.job_id,
                        d.rank,
                        d.worker_id,
                        d.assignment_id,
                        why,
                    )
                self.metrics.pass_done(started, len({d.job_id for d in out}))
                sent += out
        return sent

    def sweep_pass(self) -> int:
        """The sweep controller's pass (scheduler/sweeps.py), before the scheduling pass of
        the same tick, which then places the trials it queued. Its own errors stay in it."""
        with self._lock:
            return self.sweeps.run_pass()

    def reaper_ready(self) -> bool:
        """Only after the store has answered this scheduler for a full heartbeat timeout:
        during an outage (or before this process started) no worker could write its
        heartbeat, so a stale one proves nothing yet."""
        ok = self._store_ok_since
        return ok is not None and time.monotonic() - ok >= self.settings.heartbeat_timeout_s

    def reap(self) -> int:
        if not self.reaper_ready():
            return 0
        with self._lock, session_scope(self.settings.db_url) as s:
            reaped = reap_stale_workers(s, self.settings.heartbeat_timeout_s)
            unsupervised = lose_unsupervised_attempts(s)
            freed = release_orphaned_workers(s)
        self.metrics.reaped(len(reaped), len(unsupervised), len(freed))
        if unsupervised:
            log.warning("attempts nobody supervised any more, lost: jobs %s", unsupervised)
        for wid, jobs in reaped:
            log.warning("worker %s lost (stale heartbeat); jobs re-queued or failed: %s", wid, jobs)
        for wid in freed:
            log.info("worker %s released (its assignment was over)", wid)
        return len(reaped) + len(unsupervised) + len(freed)

    def reconcile(self) -> int:
        older = utcnow() - timedelta(seconds=RESEND_AFTER_S)
        with self._lock:
            with session_scope(self.settings.db_url) as s:
                abandoned = abandon_assignments_of_gone_workers(s, older)
            if abandoned:
                log.warning(
                    "handed back %d attempts assigned to workers that went away", len(abandoned)
                )
            expired = []
            if self.reaper_ready():  # after an outage, nobody could claim either
                with session_scope(self.settings.db_url) as s:
                    expired = expire_unclaimed(s, self.settings.claim_timeout_s)
            for job_id, wid in expired:
                log.warning(
                    "worker %s did not claim job %s within %gs: handed back, worker marked lost",
                    wid,
                    job_id,
                    self.settings.claim_timeout_s,
                )
            with session_scope(self.settings.db_url) as s:
                rows = unclaimed_assignments(s, older)
            live = {a for a, _, _ in rows}
            self._last_sent = {k: v for k, v in self._last_sent.items() if k in live}
            n = 0
            for aid, wid, queue in rows:
                if resend_due(self._last_sent, aid, RESEND_EVERY_S) and self._send(aid, queue):
                    log.info("re-sent assignment %d to %s (unclaimed)", aid, wid)
                    n += 1
            self.metrics.reconciled(len(abandoned), len(expired), n)
            return n

    def tick(self) -> None:
        ok = True
        for step in (self.reap, self.reconcile, self.sweep_pass, self.schedule_pass):
            try:
                step()
            except Exception as e:  # the next tick retries; never kill the loop
                ok = False
                log.warning("scheduler %s failed: %s", step.__name__, e)
                self.metrics.step_failed(step.__name__)
        remove_unused_bundles_due(self.settings)  # hourly at most; logs its own errors
        if not ok:
            self._store_ok_since = None
        elif self._store_ok_since is None:
            self._store_ok_since = time.monotonic()

    def _tick_loop(self) -> None:
        self.tick()
        while not self._stop.wait(self.tick_s):
            self.tick()

    def _wake(self, *_: Any, **__: Any) -> None:
        self.notifier.wake()  # a wake-up often follows a job's end
        try:
            self.schedule_pass("wake-up")
        except Exception as e:
            log.warning("scheduling pass failed: %s", e)
            self.metrics.step_failed("schedule_pass")

    def run(self) -> int:
        t = threading.Thread(target=self._tick_loop, name="scheduler-tick", daemon=True)
        t.start()
        threading.Thread(
            target=self.notifier.run, args=(self._stop,), name="webhook-sender", daemon=True
        ).start()
        self.app.task(name=SCHEDULE_TASK, acks_late=True, ignore_result=True)(self._wake)
        w = make_consumer(
            self.app, name=f"scheduler-{os.getpid()}", queue=control_queue(self.settings)
        )
        try:
            w.start()
        finally:
            self._stop.set()
            t.join(timeout=10)
        return int(w.exitcode or 0)
