"""Sweep rungs, between a trial's worker and its trainer (torch-free: both sides read it).

A trial of a sweep with a pruner stops at each rung until the pruner has decided, so it
never trains past a rung it should not pass and a pruned trial ends where it was judged:

1. before the launch the worker writes the rung plan, `rungs.json` in the run directory
   (`RungPlan`: the objective and the evaluations that are rungs);
2. at a rung, after its evaluation, the trainer writes a `rung` event (the evaluation's
   index, the objective's name and value) and waits;
3. the worker records the event's metrics, asks the pruner (store/pruning.py), and writes
   its answer, `rung-<index>.json` (`RungVerdict`), where the trainer reads it: go on, or
   stop here as pruned (exit `PRUNED` of contracts/exitcodes.py).

The resource the pruner counts is the evaluation's index (1 at the first evaluation of a
run, one more at each), not the global step: trials whose batch size differs still meet
at the same rungs. The trainer's own files are its to write, so the verdict file is only
the fast path: a trainer that ignores a `prune` is stopped by its worker's signals.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PLAN_FILE = "rungs.json"
MAX_RUNGS = 64
# How the attempt of a trial paused at a rung (synchronous halving) ends: handed back, its
# reason starting with this (the store tells such hand-backs from a failing host's).
PAUSED_AT = "paused at step "


class RungPlan(BaseModel):
    """Where a trial stops for a decision: at the evaluations listed in `rungs`, or at
    every evaluation (`every`). `offset`: objective points recorded before this attempt
    (a script job counts its reports on from there)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    metric: str
    rungs: list[int] = Field(default_factory=list, max_length=MAX_RUNGS)
    every: bool = False
    offset: int = 0

    def is_rung(self, index: int) -> bool:
        return index >= 1 and (self.every or index in self.rungs)


class RungVerdict(BaseModel):
    """The pruner's answer at one rung; `reason` says why a trial was pruned (or paused).
    `pause` (synchronous halving) is the worker's alone, never written for the trainer: the
    worker stops the waiting trainer as for a preemption, so it checkpoints at the rung."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    index: int
    prune: bool
    reason: str = ""
    pause: bool = False


def verdict_file(index: int) -> str:
    """The name of the verdict for the rung at evaluation `index`, in the run directory."""
    return f"rung-{index}.json"
