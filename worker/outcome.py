"""How a trainer process ended, classified into an attempt outcome (pure: no store, no
processes). What an outcome does to the job is `store.lifecycle.finish_attempt`'s call.

Rules, first match wins:
- cancel requested -> cancelled (succeeded still wins if the trainer finished first); a
  sweep trial its pruner stopped at a rung -> cancelled, its reason `pruned at step N: …`;
- the run directory over TORCHYARD_MAX_RUN_DIR_BYTES (the worker measured it) -> failed
  as `run_dir_full`, not retried: the job's own doing, whether or not it finished;
- rank 0's `finished` (or exit 0) -> succeeded, even if the worker was stopping by then;
- preempted for a higher-priority job (the supervisor stopped it) -> handed back;
- a sweep trial paused at a rung (synchronous halving: the supervisor stopped it) ->
  handed back, its reason `paused at step N: …` (the store holds it for the controller);
- the worker stopping, or stopping its trainer after losing the store -> handed back;
- the job's storage full (exit 5, or an `error` of kind storage_full) -> handed back, but
  only when the worker's own look (worker/runlimits.py) found the file system full: user
  code can write that event or exit 5 itself, so without the worker's evidence it is an
  ordinary failure (counted, retried);
- an `error` event of kind peer_failed (another rank died first) -> lost, retried; the
  supervisor first lets the failed rank's worker decide with the real cause;
- an `error` event -> failed with "kind: message" (nonfinite_loss, data, out_of_memory,
  unsupported, user_code, init, spec, model_too_large and run_dir_full are deterministic, so
  the job fails at once; other kinds are retried). Every rank
  reports its own error, so a rank that fails alone is classified by its cause;
- the trainer stopped itself (a `stopped` event, exit 75) -> handed back when its lease
  lapsed (the worker's own record: it could not vouch for it, e.g. frozen or cut off), else
  an ordinary failure (counted, retried): user code can exit 75 too;
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
from torchyard.contracts.eventmodel import HOST_FAULT_KINDS
from torchyard.contracts.rungs import PAUSED_AT
from torchyard.store.states import (
    A_CANCELLED,
    A_FAILED,
    A_HANDED_BACK,
    A_LOST,
    A_SUCCEEDED,
    CANCELLING,
)

DETERMINISTIC_ERRORS = frozenset(
    {"nonfinite_loss", "data", "out_of_memory", "unsupported", "user_code", "init", "spec",
     "model_too_large", "run_dir_full"}
)  # fmt: skip

# Why the worker itself stopped its trainer (None: it exited on its own).
STOP_CANCEL, STOP_WORKER, STOP_STORE_LOST = "cancel", "stopping", "store_lost"
STOP_PREEMPT = "preempted"
STOP_PRUNED = "pruned"  # the sweep's pruner pruned the trial at a rung (store/pruning.py)
STOP_PAUSED = "paused"  # synchronous halving paused the trial at a rung (store/pruning.py)


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
    # The worker's own findings (worker/runlimits.py): the run directory over its limit,
    # and what showed the file system full (None: it saw room, or did not look).
    run_dir_full: str | None = None
    storage_evidence: str | None = None
    storage_seen: str = "room"  # what the worker saw instead, for the reason
    # The worker's own record that the trainer's lease went stale while it ran (so a stop
    # it did not ask for was the lease's doing, not the job's).
    lease_lapsed: bool = False
    prune_reason: str | None = None  # why the pruner stopped it (STOP_PRUNED, STOP_PAUSED)

    def claims_storage_full(self) -> bool:
        """The trainer says the host's storage is full: exit 5 or a `storage_full` error."""
        kind = (self.error or {}).get("kind")
        return self.rc == exitcodes.STORAGE_FULL or kind in HOST_FAULT_KINDS


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
    if e.stop_why in (STOP_CANCEL, STOP_PRUNED) or e.job_state == CANCELLING:
        if e.rc == exitcodes.OK and e.finished:
            return Decision(A_SUCCEEDED, "finished before the cancel arrived", None, False)
        if e.stop_why == STOP_PRUNED:
            return Decision(A_CANCELLED, e.prune_reason or f"pruned{step}", None, False)
        return Decision(A_CANCELLED, f"cancelled{step}", None, False)
    if e.run_dir_full is not None:
        msg = f"run_dir_full: {e.run_dir_full}{step}; the worker stopped the trainer"
        return Decision(A_FAILED, msg, msg, False)
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
    if e.stop_why == STOP_PAUSED:
        why = e.prune_reason or f"{PAUSED_AT.strip()} {e.last_step}: at a rung"
        return Decision(A_HANDED_BACK, why, None, False)
    if e.stop_why == STOP_WORKER:
        why = f"worker {e.worker_id} stopping; trainer {describe_exit(e.rc)}{step}"
        return Decision(A_HANDED_BACK, why, None, False)
    if e.stop_why == STOP_STORE_LOST:
        why = f"worker {e.worker_id} lost the store; trainer stopped{step} so that no other attempt overlaps it"
        return Decision(A_HANDED_BACK, why, None, False)
    if e.claims_storage_full() and e.storage_evidence is not None:
        # The worker's storage, not the job: retried when there is room, never counted.
        detail = _message(e) or "no space left on the job's storage"
        why = f"storage full on worker {e.worker_id}{step}: {detail} ({e.storage_evidence})"
        return Decision(A_HANDED_BACK, why, None, False)
    return None


def _message(e: Ending) -> str:
    """The error event's message, at most 4000 characters (as the trainer cuts it)."""
    return str((e.error or {}).get("message") or "")[:4000]


def _unproven_storage_full(e: Ending, step: str) -> Decision:
    """The trainer says the storage is full, the worker saw room: the job's own failure."""
    said = f"exit {e.rc}" if e.rc == exitcodes.STORAGE_FULL else "an error of kind storage_full"
    msg = (
        f"rank {e.rank} trainer reported a full storage ({said}{step}) but worker "
        f"{e.worker_id} found {e.storage_seen} on the run directory's file system: counted "
        f"as the job's failure. {_message(e)}"
    ).strip()
    return Decision(A_FAILED, msg, msg, True)


def _trainer_ended(e: Ending, step: str) -> Decision:
    """How the trainer ended on its own: its error event first, then its exit status."""
    if e.claims_storage_full():
        return _unproven_storage_full(e, step)
    if e.error is not None:
        kind = str(e.error.get("kind", "internal"))
        msg = f"{kind}: {_message(e)}".strip()
        if e.rank != 0:
            msg = f"rank {e.rank}: {msg}"
        if kind == "peer_failed":
            return Decision(A_LOST, msg, None, True)
        return Decision(A_FAILED, msg, msg, kind not in DETERMINISTIC_ERRORS)
    if e.stopped or e.rc == exitcodes.PREEMPTED:
        if e.lease_lapsed:
            why = f"trainer stopped itself when its lease went stale{step}"
            return Decision(A_HANDED_BACK, why, None, False)
        msg = (
            f"rank {e.rank} trainer stopped itself (exit {e.rc}){step} although neither the "
            "worker nor its lease asked it to: counted as a failure"
        )
        return Decision(A_FAILED, msg, msg, True)
    if e.rc == exitcodes.BAD_SPEC:
        msg = "the trainer refused the spec or its arguments (exit 2); see the job log"
        return Decision(A_FAILED, msg, msg, False)
    if e.rc in (exitcodes.NONFINITE_LOSS, exitcodes.OUT_OF_MEMORY):
        msg = f"{exitcodes.NAMES[e.rc]} (exit {e.rc}); see the job log"
        return Decision(A_FAILED, msg, msg, False)
    if e.oom_killed and e.rc in (-signal.SIGKILL, 128 + signal.SIGKILL):  # 137: bwrap's way
        msg = (
            f"out_of_memory: rank {e.rank} trainer killed by the kernel's OOM killer{step}; "
            "use a smaller model or batch, or a host with more memory"
        )
        return Decision(A_FAILED, msg, msg, False)
    if e.rc < 0:
        return Decision(A_LOST, f"rank {e.rank} trainer {describe_exit(e.rc)}{step}", None, True)
    msg = f"rank {e.rank} trainer {describe_exit(e.rc)}{step}; see the job log"
    return Decision(A_FAILED, msg, msg, True)
