"""Exit codes of `python -m torchyard.trainer` / each torchrun rank.

Torch-free and import-free, so the worker can map an exit status to an outcome
without loading the trainer. Under torchrun the launcher's own exit status is
not these codes (it reports any failed rank as 1): read the run's events
(`stopped`, `error`, `finished`) for the outcome instead.
"""

from __future__ import annotations

OK = 0
"""Training finished; a `finished` event was written."""
FAILED = 1
"""An `error` event was written (kind `data` or `internal`)."""
BAD_SPEC = 2
"""The spec (or the command line) is invalid; nothing was written."""
NONFINITE_LOSS = 3
"""The loss became NaN/inf; an `error` event (kind `nonfinite_loss`) names the step."""
OUT_OF_MEMORY = 4
"""The device (or host) ran out of memory; an `error` event (kind `out_of_memory`) was written."""
STORAGE_FULL = 5
"""The run directory's file system is full (or over quota): not the job's fault, so the
worker hands it back instead of counting a failure, once it has found the file system full
itself (user code can exit 5 too: without the worker's own evidence it is an ordinary,
counted failure; worker/outcome.py). An `error` event (kind `storage_full`) is written if
there is room for it."""
PREEMPTED = 75
"""SIGTERM (or SIGINT) received: a checkpoint was saved, a `stopped` event written; resumable."""
PRUNED = 76
"""A sweep trial stopped at a rung because its worker said the pruner pruned it
(contracts/rungs.py); a `stopped` event with signal `pruned` was written, no checkpoint."""

NAMES = {
    OK: "ok",
    FAILED: "failed",
    BAD_SPEC: "bad_spec",
    NONFINITE_LOSS: "nonfinite_loss",
    OUT_OF_MEMORY: "out_of_memory",
    STORAGE_FULL: "storage_full",
    PREEMPTED: "preempted",
    PRUNED: "pruned",
}
