"""The worker's lease on its trainer (torch-free).

The worker's watchdog refreshes a file's mtime while it can vouch for its trainer: the
store answers it and its supervision loop runs. A trainer whose lease goes stale (its
worker frozen by SIGSTOP, cut off from the store by a partition, or hung) stops on its
own: it checkpoints and exits at the next step, as on SIGTERM, and exits outright if that
takes too long. The old trainer is thus gone before the scheduler's reaper can give the
job to another worker, so two attempts of one job never run at once.

Set by the worker: TORCHYARD_LEASE_FILE (the file), TORCHYARD_LEASE_STOP_S (stale this
long: checkpoint and stop), TORCHYARD_LEASE_KILL_S (stale this long: exit now). Without
TORCHYARD_LEASE_FILE (a trainer run by hand) there is no lease.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

from torchyard.contracts import exitcodes
from torchyard.trainer.signals import StopFlag

ENV_FILE, ENV_STOP, ENV_KILL = (
    "TORCHYARD_LEASE_FILE",
    "TORCHYARD_LEASE_STOP_S",
    "TORCHYARD_LEASE_KILL_S",
)
LEASE_SIGNAL = "lease expired"


class LeaseError(ValueError):
    """A lease variable that is set but unusable (named in the message)."""


def _seconds(name: str) -> float:
    raw = os.environ.get(name)
    try:
        v = float(raw) if raw is not None else math.nan
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise LeaseError(
            f"{name} must be a positive number of seconds when {ENV_FILE} is set, not {raw!r}"
        )
    return v


def lease_age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return math.inf  # the worker removed it: nobody vouches any more


def watch_lease(stop: StopFlag, done: threading.Event | None = None) -> threading.Thread | None:
    """Start the watcher thread when the worker set a lease (None otherwise). It watches
    for the life of the process unless `done` is set: a process that outlives the trainer
    (a test calling this in-process) must end it, or a stale lease kills that process."""
    path = os.environ.get(ENV_FILE)
    if not path:
        return None
    stop_s, kill_s = _seconds(ENV_STOP), _seconds(ENV_KILL)
    if kill_s <= stop_s:
        raise LeaseError(f"{ENV_KILL} ({kill_s:g}) must be more than {ENV_STOP} ({stop_s:g})")
    every = min(0.1, stop_s / 4)

    def watch() -> None:
        while done is None or not done.is_set():
            age = lease_age(path)
            if age > kill_s:
                print(
                    f"trainer: lease stale for {age:.1f}s; exiting now", file=sys.stderr, flush=True
                )
                os._exit(exitcodes.PREEMPTED)
            if age > stop_s and stop.signal is None:
                print(
                    f"trainer: lease stale for {age:.1f}s (worker unreachable); checkpointing and stopping",
                    file=sys.stderr,
                    flush=True,
                )
                stop.signal = LEASE_SIGNAL
            time.sleep(every)

    t = threading.Thread(target=watch, name="lease", daemon=True)
    t.start()
    return t
