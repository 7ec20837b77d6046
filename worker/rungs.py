"""A sweep trial's rungs on its worker (the protocol is contracts/rungs.py): the plan written
before the launch, and at each rung the pruner's verdict, asked as soon as the trainer's
`rung` event is read (store/pruning.py) and written where the trainer waits for it.

Only rank 0's supervisor answers (it reads the events); every rank's run directory gets the
plan, since every rank's trainer stops at the rungs. What the trainer writes is not
trusted: a rung event the plan does not list, or one already answered, is ignored, and a
trainer that does not stop when pruned is killed by its supervisor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchyard.contracts.eventmodel import RungEvent
from torchyard.contracts.rungs import PLAN_FILE, RungPlan, RungVerdict, verdict_file
from torchyard.store.pruning import Pruning, objective_points, rung_plan
from torchyard.worker.events import Tx
from torchyard.worker.runfiles import remove_run_files, write_run_file

log = logging.getLogger(__name__)

ASK_AGAIN_S = 0.5  # after the store failed to answer; the trainer waits meanwhile


@dataclass
class Answered:
    """A verdict written for the trainer, with the step of its rung."""

    verdict: RungVerdict
    step: int


@dataclass
class Rungs:
    """One attempt's rungs: what its plan lists, and what was answered."""

    pruning: Pruning
    run_dir: Path
    job_id: str
    plan: RungPlan
    answered: set[int] = field(default_factory=set)
    retry_at: float = 0.0
    failing: bool = False  # the last ask failed (logged once until one succeeds)

    def answer(self, pending: list[RungEvent]) -> Answered | None:
        """Answer the rungs the trainer reported, in order, removing each answered one from
        `pending`; a store error leaves it there for a later call. Returns the verdict that
        pruned or paused the trial, if one did (nothing after it is answered)."""
        while pending and time.monotonic() >= self.retry_at:
            ev = pending[0]
            index = ev.index
            if index is None or not self.plan.is_rung(index) or index in self.answered:
                pending.pop(0)  # not a rung of the plan: the trainer's own business
                continue
            try:
                verdict = self.pruning.decide(self.job_id, index, _num(ev.value), ev.step or 0)
            except Exception as e:
                self._failed(e)
                return None
            self.failing = False
            pending.pop(0)
            self.answered.add(index)
            if verdict.pause:  # never the trainer's: its supervisor stops it (checkpointed)
                pending.clear()
                return Answered(verdict, ev.step or 0)
            self._write(verdict)
            if verdict.prune:
                pending.clear()
                return Answered(verdict, ev.step or 0)
        return None

    def _failed(self, e: Exception) -> None:
        self.retry_at = time.monotonic() + ASK_AGAIN_S
        if not self.failing:
            log.warning("job %s: the pruner could not answer (%s); the trainer waits, "
                        "asked again", self.job_id, e)  # fmt: skip
        self.failing = True

    def _write(self, verdict: RungVerdict) -> None:
        try:
            write_run_file(
                self.run_dir, verdict_file(verdict.index), verdict.model_dump_json().encode()
            )
        except OSError as e:  # the trainer blocked the name: it waits, or it is stopped
            log.warning("job %s: could not write the rung verdict (%s)", self.job_id, e)


def _num(v: float | int | None) -> float | None:
    return None if v is None else float(v)


def prepare_rungs(
    pruning: Pruning | None, run_dir: Path, job_id: str, metric: str | None,
    pruner: str | None, tx: Tx,
) -> Rungs | None:  # fmt: skip
    """Before a launch: the plan into the run directory (an earlier attempt's verdicts
    removed), the pruner's storage opened in the background; None when the job is no
    trial of a sweep with a pruner."""
    remove_run_files(run_dir, "rung-", ".json")
    plan = rung_plan(pruner, metric) if pruner and metric and pruning is not None else None
    if plan is None or pruning is None or metric is None:
        return None
    offset = tx(lambda s: objective_points(s, job_id, metric))
    plan = plan.model_copy(update={"offset": offset})
    write_run_file(run_dir, PLAN_FILE, plan.model_dump_json().encode())
    pruning.warm()
    return Rungs(pruning, run_dir, job_id, plan)
