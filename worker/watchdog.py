"""The worker's watchdog: the thread that decides whether this worker can still vouch for
its trainer, and acts when it cannot. It never touches the store or the broker, so no
hung connection can stop it.

The worker vouches while the store answered it recently and its supervision loop is going
round. While it does, the watchdog refreshes the trainer's lease file (`trainer/lease.py`);
when it stops vouching, the trainer checkpoints and stops on its own, and the watchdog
also sends SIGTERM and then SIGKILL (through the trainer's handle, worker/launcher.py: the
leader, then the whole group). A worker that is frozen (SIGSTOP) cannot refresh the lease
either, so its trainer stops all the same.

Timing, as fractions of the heartbeat timeout T (the reaper gives a job away at the
earliest T after the worker's last heartbeat on the database's clock, and heartbeats
come every interval < T/3):
- VOUCH = 0.25 T: the lease is refreshed only while the store answered within it;
- the trainer checkpoints and stops when its lease is LEASE_STOP = 0.15 T stale and exits
  outright at LEASE_KILL = 0.35 T, i.e. at most 0.6 T after the last store contact;
- the watchdog's own SIGTERM comes at 0.4 T and SIGKILL at 0.6 T of store silence.
So the old trainer is gone before T - interval (> 0.66 T), before anyone can start the
job again.

A second thread of the watchdog, the disk watch, looks at the running trainer's run
directory every DISK_EVERY_S (longer when a look is slow: never more than a tenth of its
time): over TORCHYARD_MAX_RUN_DIR_BYTES it kills the trainer and records why
(`ctx.run_dir_full`: the job fails as `run_dir_full`); a full file system is noted
(`ctx.low_space_at`), the worker's own evidence when a trainer blames the storage
(worker/runlimits.py). It is a thread of its own so that a slow walk of a big tree never
delays a lease refresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from torchyard.worker.runlimits import low_space, run_dir_over
from torchyard.worker.supervisor import WorkerContext

log = logging.getLogger(__name__)

VOUCH, LEASE_STOP, LEASE_KILL = 0.25, 0.15, 0.35
TERM_AT, KILL_AT = 0.4, 0.6
TICK_S = 0.1
DISK_EVERY_S = 2.0


class Watchdog:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.t = ctx.settings.heartbeat_timeout_s
        # Under the worker's home, not /tmp: what a SIGKILLed worker leaves stays with it.
        leases = ctx.settings.home.resolve() / "leases"
        leases.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=leases))
        self.lease_file = self._dir / "trainer.lease"
        self.lease_file.touch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self._disk = threading.Thread(target=self._disk_loop, name="diskwatch", daemon=True)

    def lease_env(self) -> dict[str, str]:
        """What the trainer needs to watch its lease."""
        return {
            "TORCHYARD_LEASE_FILE": str(self.lease_file),
            "TORCHYARD_LEASE_STOP_S": f"{LEASE_STOP * self.t:g}",
            "TORCHYARD_LEASE_KILL_S": f"{LEASE_KILL * self.t:g}",
        }

    def loop_stalled(self, now: float) -> bool:
        beat = self.ctx.loop_beat
        return beat is not None and now - beat > VOUCH * self.t

    def vouches(self, now: float) -> bool:
        return now - self.ctx.store_ok_at < VOUCH * self.t and not self.loop_stalled(now)

    def check(self, now: float) -> None:
        """One look: refresh the lease, or stop a trainer nobody can vouch for."""
        if self.vouches(now):
            with contextlib.suppress(OSError):
                os.utime(self.lease_file)
            self.ctx.lease_refreshed(now)
            return
        trainer = self.ctx.trainer  # the launcher's handle (worker/launcher.py)
        if trainer is None or trainer.poll() is not None:
            return
        silent = now - min(self.ctx.store_ok_at, self.ctx.loop_beat or now)
        if silent >= KILL_AT * self.t:
            log.warning("watchdog: no store or supervision for %.1fs; SIGKILL trainer", silent)
            trainer.kill()
        elif silent >= TERM_AT * self.t and not self.ctx.store_lost_stop.is_set():
            log.warning(
                "watchdog: no store or supervision for %.1fs; stopping the trainer before "
                "its job can be given to another worker",
                silent,
            )
            self.ctx.store_lost_stop.set()
            trainer.terminate()

    def check_disk(self) -> float:
        """One look at the running trainer's run directory (see the module's docstring);
        returns how long it took."""
        t0 = time.monotonic()
        run_dir, trainer = self.ctx.watch_dir, self.ctx.trainer
        if run_dir is None or trainer is None or trainer.poll() is not None:
            return 0.0
        if low_space(run_dir) is not None:
            self.ctx.low_space_at = time.monotonic()
        # A sandboxed trainer writes its private `/code` too: it counts (TrainerHandle.writable).
        also = tuple(getattr(trainer, "writable", ()))
        over = run_dir_over(run_dir, self.ctx.settings.max_run_dir_bytes, also)
        if over is not None and self.ctx.run_dir_full is None:
            log.warning("diskwatch: %s; SIGKILL trainer", over)
            self.ctx.run_dir_full = over
            trainer.kill()
        return time.monotonic() - t0

    def _disk_loop(self) -> None:
        wait = DISK_EVERY_S
        while not self._stop.wait(wait):
            try:
                wait = max(DISK_EVERY_S, 10 * self.check_disk())
            except Exception:  # never let the disk watch die
                log.exception("disk watch failed")

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.check(time.monotonic())
            except Exception:  # never let the watchdog die
                log.exception("watchdog check failed")

    def start(self) -> None:
        self._thread.start()
        self._disk.start()

    def stop(self) -> None:
        self._stop.set()
        for t in (self._thread, self._disk):
            if t.is_alive():
                t.join(timeout=2)
        with contextlib.suppress(OSError):
            self.lease_file.unlink()
            self._dir.rmdir()
