"""The pruner of a sweep, and its decisions at a trial's rungs (the protocol with the trainer
is contracts/rungs.py).

A decision is made where the objective arrives: the trial's worker, on its ingest path,
asks Optuna's pruner as soon as it has read the trainer's `rung` event, while the trainer
waits (worker/supervisor.py). A pruned trial is recorded here, in one transaction under the
sweep's row lock (the controller's passes and a sweep cancel take turns with it): its
outcome `pruned` with the value and step it reached, and its job's cancel (reason
`pruned …`). Optuna is told after that commit; a lost tell is told again by the
controller's next pass (scheduler/sweeps.py `settle`).

The pruners count evaluations, not steps (contracts/rungs.py): `asha` is Optuna's
SuccessiveHalvingPruner with rungs at evaluations 1, 3, 9, 27, … (`rung_plan` lists the
same), the best third of the trials at a rung going on; `median` is Optuna's MedianPruner,
which may decide at every evaluation.

`halving` is synchronous successive halving on the same rungs, decided here and never by
Optuna's pruner (the study's is a NopPruner): of the n trials that reach a rung, the best
max(1, n // 3) go on. A decision is made only when it is certain (`halving_verdict`): a
trial is pruned once that many already did better, goes on once fewer could still beat
it; otherwise it is paused. Its worker then stops the trainer as for a preemption (it
checkpoints at the rung) and hands the job back, held in the queue
(store/lifecycle.py), with its trial's `paused_rung` set; the sweep's controller
re-decides paused trials each pass (scheduler/sweeps.py) and releases or prunes them.
ASHA decides at once from the trials seen so far, so a trial that is best early runs on
whatever comes later; halving waits, at the cost of a restart from the rung's checkpoint.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from torchyard.contracts.rungs import MAX_RUNGS, RungPlan, RungVerdict
from torchyard.store.db import session_scope
from torchyard.store.jobs import request_cancel
from torchyard.store.models import Job, Metric, Sweep, SweepTrial
from torchyard.store.states import CANCELLING, TERMINAL
from torchyard.store.sweeps import PRUNED, end_trial, lock_sweep, optuna_storage

if TYPE_CHECKING:
    from optuna import Study
    from optuna.pruners import BasePruner
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

log = logging.getLogger(__name__)

ASHA_MIN_RESOURCE = 1  # the first rung: the first evaluation
ASHA_REDUCTION = 3  # a third of the trials at a rung go on to the next
MEDIAN_STARTUP_TRIALS = 5  # MedianPruner's default: no pruning before 5 complete trials
HALVING = "halving"
RUNG_PRUNERS = ("asha", HALVING)  # pruners that stop at rungs 1, 3, 9, 27, …
GO, PRUNE, PAUSE = "go", "prune", "pause"  # halving's verdicts


def make_pruner(name: str) -> BasePruner:
    """The Optuna pruner a sweep's `pruner` names."""
    import optuna

    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=ASHA_MIN_RESOURCE, reduction_factor=ASHA_REDUCTION
        )
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP_TRIALS)
    return optuna.pruners.NopPruner()


def rung_plan(pruner: str, metric: str, offset: int = 0) -> RungPlan | None:
    """Where a trial of a sweep with `pruner` waits (None: never)."""
    if pruner in RUNG_PRUNERS:
        rungs = [ASHA_MIN_RESOURCE * ASHA_REDUCTION**k for k in range(MAX_RUNGS)]
        return RungPlan(metric=metric, rungs=[r for r in rungs if r < 2**31], offset=offset)
    if pruner == "median":
        return RungPlan(metric=metric, every=True, offset=offset)
    return None


def objective_points(session: Session, job_id: str, metric: str) -> int:
    """How many points of the objective a job has recorded (a resumed script's count)."""
    q = select(func.count()).where(Metric.job_id == job_id, Metric.name == metric)
    return int(session.scalar(q) or 0)


def halving_verdict(mine: float, others: list[float], could_reach: int, maximize: bool) -> str:
    """Synchronous halving's verdict on a trial at a rung, given the values of the other
    trials that reported there and how many more may still reach it: of all n of them the
    best keep = max(1, n // 3) go on. PRUNE once `keep` others did better, GO once fewer
    than `keep` could still beat it (those that did and every one yet to come), else PAUSE.
    Each verdict holds whatever the rest report: a trial that fails before the rung only
    makes n, and keep with it, smaller. A value not finite is the worst; ties go on."""
    keep = max(1, (len(others) + 1 + could_reach) // ASHA_REDUCTION)
    sign = 1.0 if maximize else -1.0

    def score(v: float) -> float:
        return sign * v if math.isfinite(v) else -math.inf

    me = score(mine)
    better = sum(1 for v in others if score(v) > me)
    if better >= keep:
        return PRUNE
    if better + could_reach < keep:
        return GO
    return PAUSE


def rung_field(
    trials: list[FrozenTrial], number: int, index: int, max_trials: int
) -> tuple[list[float], int]:
    """For trial `number` at rung `index`: the values the other trials reported there, and
    how many may still reach it (trials running below it, paused ones among them, and the
    trials the sweep has yet to ask for)."""
    from optuna.trial import TrialState

    others: list[float] = []
    could_reach = max(0, max_trials - len(trials))
    for t in trials:
        if t.number == number:
            continue
        v = t.intermediate_values.get(index)
        if v is not None:
            others.append(float(v))
        elif t.state == TrialState.RUNNING:
            could_reach += 1
    return others, could_reach


def halving_why(metric: str, value: float, index: int) -> str:
    """Why synchronous halving pruned a trial."""
    shown = f"{value:.4g}" if math.isfinite(value) else "not finite"
    return (
        f"{metric} {shown} at evaluation {index} is not in the best third of the trials "
        f"that reach this rung (synchronous halving)"
    )


def _why(pruner: str, metric: str, value: float, index: int) -> str:
    shown = f"{value:.4g}" if math.isfinite(value) else "not finite"
    if pruner == HALVING:
        return halving_why(metric, value, index)
    if pruner == "asha":
        return (
            f"{metric} {shown} at evaluation {index} is not in the best third of the "
            f"trials that reached this rung (ASHA)"
        )
    return f"{metric} {shown} at evaluation {index} is worse than the trials' median"


class Pruning:
    """The decisions of one worker process: Optuna's storage is opened once (`warm`, in the
    background, when a trial with rungs is about to start, so the first rung does not pay
    for importing Optuna) and each sweep's study is loaded once."""

    def __init__(self, db_url: str):
        self.db_url = db_url
        self._lock = threading.Lock()
        self._storage: RDBStorage | None = None
        self._studies: dict[str, Study] = {}

    def warm(self) -> None:
        """Open the storage in a daemon thread (errors are left for `decide` to meet)."""
        threading.Thread(target=self._quiet_open, name="pruning-warm", daemon=True).start()

    def _quiet_open(self) -> None:
        try:
            self.storage()
        except Exception as e:
            log.info("opening Optuna's storage failed; retried at the first rung (%s)", e)

    def storage(self) -> RDBStorage:
        with self._lock:
            if self._storage is None:
                import optuna

                optuna.logging.set_verbosity(optuna.logging.WARNING)
                self._storage = optuna_storage(self.db_url)
            return self._storage

    def study(self, sweep_id: str, pruner: str) -> Study:
        import optuna

        study = self._studies.get(sweep_id)
        if study is None:
            study = optuna.load_study(
                study_name=sweep_id,
                storage=self.storage(),
                pruner=make_pruner(pruner),
                sampler=optuna.samplers.RandomSampler(),  # never asked: TPE's setup skipped
            )
            self._studies = {**dict(list(self._studies.items())[-31:]), sweep_id: study}
        return study

    def decide(self, job_id: str, index: int, value: float | None, step: int) -> RungVerdict:
        """The pruner's verdict on job `job_id`'s trial at evaluation `index`; a pruned
        trial is recorded (with its job's cancel) before this returns. Store errors raise:
        the caller asks again (the trainer keeps waiting)."""
        with session_scope(self.db_url) as s:
            row = s.execute(
                select(
                    SweepTrial.sweep_id,
                    SweepTrial.number,
                    SweepTrial.outcome,
                    Sweep.pruner,
                    Sweep.metric,
                    Sweep.mode,
                    Sweep.max_trials,
                )
                .join(Sweep, Sweep.id == SweepTrial.sweep_id)
                .where(SweepTrial.job_id == job_id)
            ).first()
        if row is None or row.outcome is not None:  # decided already (a retried verdict)
            return RungVerdict(index=index, prune=row is not None and row.outcome == PRUNED)
        v = float("nan") if value is None else float(value)
        if row.pruner == HALVING:
            return self._halving(row, job_id, index, v, step)
        if not self._should_prune(row.sweep_id, row.pruner, row.number, index, v):
            return RungVerdict(index=index, prune=False)
        why = _why(row.pruner, row.metric, v, index)
        if not self._record(row.sweep_id, job_id, v, step, why):
            return RungVerdict(index=index, prune=False)  # the trial ended otherwise first
        self._tell_pruned(row.sweep_id, row.pruner, row.number)
        return RungVerdict(index=index, prune=True, reason=why)

    def _halving(self, row: Any, job_id: str, index: int, v: float, step: int) -> RungVerdict:
        """Synchronous halving at a rung: go on, pruned (recorded as for any pruner), or
        paused (recorded: the worker stops the trainer and the job is held)."""
        go = RungVerdict(index=index, prune=False)
        study = self.study(row.sweep_id, row.pruner)
        if self._report(study, row.number, index, v) is None:
            return go
        others, could_reach = rung_field(
            study.get_trials(deepcopy=False), row.number, index, row.max_trials
        )
        verdict = halving_verdict(v, others, could_reach, row.mode == "max")
        if verdict == GO:
            return go
        if verdict == PRUNE:
            why = _why(row.pruner, row.metric, v, index)
            if not self._record(row.sweep_id, job_id, v, step, why):
                return go  # the trial ended otherwise first
            self._tell_pruned(row.sweep_id, row.pruner, row.number)
            return RungVerdict(index=index, prune=True, reason=why)
        if not self._pause(row.sweep_id, job_id, index):
            return go  # ended or cancelled meanwhile: its own stop follows
        shown = f"{v:.4g}" if math.isfinite(v) else "not finite"
        why = (
            f"{row.metric} {shown} at evaluation {index}: paused until the trials still "
            f"running reach this rung (synchronous halving)"
        )
        return RungVerdict(index=index, prune=False, pause=True, reason=why)

    def _report(self, study: Study, number: int, index: int, v: float) -> Any:
        """Report `v` at `index` for trial `number`: its optuna.Trial, or None when Optuna's
        trial has ended (a cancel's outcome told)."""
        import optuna

        storage = self.storage()
        trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
        trial = optuna.Trial(study, trial_id)
        try:
            # A resumed trial (released by halving, preempted) reaches its rung again: it
            # was told once (Optuna would warn and keep the first value anyway).
            if index not in storage.get_trial(trial_id).intermediate_values:
                trial.report(v, index)
        except RuntimeError as e:
            log.info("sweep %s trial %d: not reported at %d (%s)", study.study_name, number,
                     index, e)  # fmt: skip
            return None
        return trial

    def _should_prune(self, sweep_id: str, pruner: str, number: int, index: int, v: float) -> bool:
        trial = self._report(self.study(sweep_id, pruner), number, index, v)
        return trial is not None and bool(trial.should_prune())

    def _pause(self, sweep_id: str, job_id: str, index: int) -> bool:
        """The trial paused at `index`, under the sweep's lock; False when it has an
        outcome or its job is ending (a cancel: its own stop follows)."""
        with session_scope(self.db_url) as s:
            lock_sweep(s, sweep_id)
            trial = s.scalars(select(SweepTrial).where(SweepTrial.job_id == job_id)).first()
            job = s.get(Job, job_id)
            if trial is None or trial.outcome is not None or job is None:
                return False
            if job.state in TERMINAL or job.state == CANCELLING:
                return False
            trial.paused_rung = index
        return True

    def _record(self, sweep_id: str, job_id: str, v: float, step: int, why: str) -> bool:
        """The trial pruned and its job cancelled, in one transaction under the sweep's
        lock; False when it had an outcome already."""
        with session_scope(self.db_url) as s:
            lock_sweep(s, sweep_id)
            trial = s.scalars(select(SweepTrial).where(SweepTrial.job_id == job_id)).first()
            if trial is None or trial.outcome is not None:
                return trial is not None and trial.outcome == PRUNED
            end_trial(trial, PRUNED, value=v if math.isfinite(v) else None)
            trial.last_step = step
            job = s.get(Job, job_id)
            if job is not None and job.state not in TERMINAL:
                request_cancel(s, job, reason=f"pruned at step {step}: {why}")
        return True

    def _tell_pruned(self, sweep_id: str, pruner: str, number: int) -> None:
        from optuna.trial import TrialState

        try:
            self.study(sweep_id, pruner).tell(
                number, state=TrialState.PRUNED, skip_if_finished=True
            )
        except Exception as e:  # the controller's next pass tells it (`settle`)
            log.warning("sweep %s: telling Optuna trial %d pruned failed: %s", sweep_id, number, e)
