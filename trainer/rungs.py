"""A sweep trial's stops at its rungs (the protocol is contracts/rungs.py): the plan the
worker wrote, and the wait for its verdict after the evaluation at a rung.

Only rank 0 talks to the worker (its `rung` event, its verdict file); under DDP the verdict
reaches every rank in one all-reduce, with each rank's own stop flag, so all ranks leave
the rung together: going on, stopping as pruned, or checkpointing for a SIGTERM that came
while they waited.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from pydantic import ValidationError

from torchyard.contracts.rungs import PLAN_FILE, RungPlan, RungVerdict, verdict_file
from torchyard.trainer.distributed import Dist, all_reduce_sum
from torchyard.trainer.events import EventSink
from torchyard.trainer.signals import StopFlag

POLL_S = 0.01  # the verdict file's poll: the wait's latency, next to a file stat's cost


class Verdict(Enum):
    GO = "go"
    PRUNE = "prune"
    STOP = "stop"  # a stop signal came while waiting: checkpoint and stop as for any


def load_plan(run_dir: Path) -> RungPlan | None:
    """The worker's plan for this run, or None (not a sweep trial with a pruner). A plan
    that does not parse is ignored: the trial then runs as if it had none."""
    try:
        return RungPlan.model_validate_json((run_dir / PLAN_FILE).read_bytes())
    except (FileNotFoundError, ValidationError, OSError):
        return None


@dataclass
class Gate:
    """Waits at the rungs of one run."""

    plan: RungPlan
    run_dir: Path
    dist: Dist
    stop: StopFlag
    events: EventSink
    log: Callable[[str], None] = print
    last: RungVerdict | None = None  # the last verdict read (its reason, for the log)

    def wait(self, index: int, step: int, value: float | None) -> Verdict:
        """Rank 0 reports the rung and waits for the verdict (or a stop signal); every rank
        returns the same answer."""
        prune = stop = 0.0
        if self.dist.is_main:
            self.events.emit("rung", step=step, index=index, name=self.plan.metric, value=value)
            verdict = self._await(index)
            prune = 1.0 if verdict is not None and verdict.prune else 0.0
        stop = 1.0 if self.stop.signal is not None else 0.0
        if self.dist.ddp:
            flags = all_reduce_sum(self.dist, torch.tensor([prune, stop], device=self.dist.device))
            prune, stop = flags.tolist()
        if prune > 0:
            return Verdict.PRUNE
        return Verdict.STOP if stop > 0 else Verdict.GO

    def _await(self, index: int) -> RungVerdict | None:
        """The verdict for `index`; None when a stop signal came first."""
        path = self.run_dir / verdict_file(index)
        while self.stop.signal is None:
            try:
                v = RungVerdict.model_validate_json(path.read_bytes())
            except (FileNotFoundError, ValidationError):
                time.sleep(POLL_S)
                continue
            if v.index == index:
                self.last = v
                return v
            time.sleep(POLL_S)
        return None
