"""How a trainer process ended, classified into an attempt outcome (pure: no store, no
processes). What an outcome does to the job is `store.lifecycle.finish_attempt`'s call.

Rules, first match wins:
- cancel requested -> cancelled (succeeded still wins if the trainer finished first);
- rank 0's `finished` (or exit 0) -> succeeded, even if the worker was stopping by then;
- preempted for a higher-priority job (the supervisor stopped it) -> handed back;
- the worker stopping, or stopping its trainer after losing the store -> handed back;
- the job's storage full (exit 5, or an `error` of kind storage_full) -> handed back;
- an `error` event of kind peer_failed (another rank died first) -> lost, retried; the
  supervisor first lets the failed rank's worker decide with the real cause;
- an `error` event -> failed with "kind: message" (nonfinite_loss, data, out_of_memory,
  unsupported, user_code, init and spec are deterministic, so the job fails at once; other kinds
  are retried). Every rank
  reports its own error, so a rank that fails alone is classified by its cause;
- a SIGTERM from outside (a `stopped` event, exit 75) -> handed back;
- exit 2 (bad spec), 3 (nonfinite loss), 4 (out of memory) -> failed, not retried;
- SIGKILL by the kernel's OOM killer -> failed as out_of_memory, not retried;
- any other signal -> lost, retried from the latest checkpoint; any other code -> failed,
  retried.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, NamedTuple

from torchyard.contracts import exitcodes
from torchyard.store.states import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_SUCCEEDED,
    CANCELLING,
)

DETERMINISTIC_ERRORS = frozenset(
    {"nonfinite_loss", "data", "out_of_memory", "unsupported", "user_code", "init", "spec"}
)

# Why the worker itself stopped its trainer (None: it exited on its own).
STOP_CANCEL, STOP_WORKER, STOP_STORE_LOST = "cancel", "stopping", "store_lost"
STOP_PREEMPT = "preempted"


class Decision(NamedTuple):
    outcome: str  # an attempt state
    reason: str
    error: str | None
    retryable: bool


@dataclass(frozen=True)
class Ending:
    """What the supervisor knows when its trainer has exited."""

    rc: int
    rank: int
    worker_id: str
    stop_why: str | None
    job_state: str | None
    finished: bool = False
    error: dict[str, Any] | None = None
    stopped: bool = False
    last_step: int | None = None
    oom_killed: bool = False
    preempted_by: str | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def decide(e: Ending) -> Decision | None:
    """The attempt's outcome, or None when another party decides (a rank other than 0
    whose trainer finished: rank 0 has the events)."""
    step = f" at step {e.last_step}" if e.last_step is not None else ""
    if e.stop_why == STOP_CANCEL or e.job_state == CANCELLING:
        if e.rc == exitcodes.OK and e.finished:
            return Decision(A_SUCCEEDED, "finished before the cancel arrived", None, False)
        return Decision(A_CANCELLED, f"cancelled{step}", None, False)
    # Rank 0's `finished` comes after the final checkpoint and weights are written: the job
    # is done even if torchrun's exit code says a rank stumbled while exiting, and even if
    # the worker began to stop after it.
    if e.rc == exitcodes.OK or (e.finished and e.error is None):
        return Decision(A_SUCCEEDED, "finished", None, False) if e.rank == 0 else None
    return _handed_back(e, step) or _trainer_ended(e, step)


def _handed_back(e: Ending, step: str) -> Decision | None:
    """A stop that is not the job's fault (a preemption, a stopping worker, a lost store, a
    full disk): handed back, not counted. None for any other ending."""
    if e.stop_why == STOP_PREEMPT:
        # Handed back, not failed: it resumes from its checkpoint when workers are free.
        return Decision(A_HANDED_BACK, f"preempted by {e.preempted_by}{step}", None, False)
    if e.stop_why == STOP_WORKER:
        why = f"worker {e.worker_id} stopping; trainer {describe_exit(e.rc)}{step}"
        return Decision(A_HANDED_BACK, why, None, False)
    if e.stop_why == STOP_STORE_LOST:
        why = f"worker {e.worker_id} lost the store; trainer stopped{step} so that no other attempt overlaps it"
        return Decision(A_HANDED_BACK, why, None, False)
    if e.rc == exitcodes.STORAGE_FULL or (e.error or {}).get("kind") == "storage_full":
        # The worker's storage, not the job: retried when there is room, never counted.
        detail = (e.error or {}).get("message") or "no space left on the job's storage"
        why = f"storage full on worker {e.worker_id}{step}: {detail}"
        return Decision(A_HANDED_BACK, why, None, False)
    return None


def _trainer_ended(e: Ending, step: str) -> Decision:
    """How the trainer ended on its own: its error event first, then its exit status."""
    if e.error is not None:
        kind = str(e.error.get("kind", "internal"))
        msg = f"{kind}: {e.error.get('message', '')}".strip()
        if e.rank != 0:
            msg = f"rank {e.rank}: {msg}"
        if kind == "peer_failed":
            return Decision(A_LOST, msg, None, True)
        return Decision(A_FAILED, msg, msg, kind not in DETERMINISTIC_ERRORS)
    if e.stopped or e.rc == exitcodes.PREEMPTED:
        return Decision(
            A_HANDED_BACK, f"trainer preempted by a SIGTERM from outside{step}", None, False
        )
    if e.rc == exitcodes.BAD_SPEC:
        msg = "the trainer refused the spec or its arguments (exit 2); see the job log"
        return Decision(A_FAILED, msg, msg, False)
    if e.rc in (exitcodes.NONFINITE_LOSS, exitcodes.OUT_OF_MEMORY):
        msg = f"{exitcodes.NAMES[e.rc]} (exit {e.rc}); see the job log"
        return Decision(A_FAILED, msg, msg, False)
    if e.oom_killed and e.rc == -signal.SIGKILL:
        msg = (
            f"out_of_memory: rank {e.rank} trainer killed by the kernel's OOM killer{step}; "
            "use a smaller model or batch, or a host with more memory"
        )
        return Decision(A_FAILED, msg, msg, False)
    if e.rc < 0:
        return Decision(A_LOST, f"rank {e.rank} trainer {describe_exit(e.rc)}{step}", None, True)
    msg = f"rank {e.rank} trainer {describe_exit(e.rc)}{step}; see the job log"
    return Decision(A_FAILED, msg, msg, True)
