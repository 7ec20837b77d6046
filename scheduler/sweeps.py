"""The sweep controller: one pass over the sweeps that have work, run by the scheduler process
every tick before its scheduling pass (scheduler/process.py: `Scheduler.sweep_pass`), so that
the trials it queues are placed in the same tick.

Each sweep is an Optuna study named by the sweep's id (storage: store/sweeps.py
`optuna_storage`); each trial is an ordinary job of the sweep's owner, so fair share,
quotas and preemption treat it like any other. Per sweep, under its row lock:

1. observe (one transaction): settle what a crash left (an Optuna trial still RUNNING with
   no trial row, from a controller that died between asking and storing, is told FAIL; one
   whose row has an outcome is told that outcome again); follow each running trial's
   objective (its newest value and step, for the trial table); a trial whose job ended gets
   its outcome: succeeded -> complete with its final value (the objective's last point),
   cancelled -> cancelled, failed -> failed. Optuna is told the outcomes after the commit.
   Pruning is not decided here: a trial waits at each rung for its worker, which asks the
   pruner as the objective arrives (store/pruning.py) and records a pruned trial itself,
   so a trial is never pruned after it finished, nor trained past the rung it failed.
   The one exception is synchronous halving's paused trials (their job handed back and
   held in the queue): each pass decides them again with the same rule, as the other
   trials reach their rung, and releases one (its hold cleared: it resumes from the
   rung's checkpoint) or prunes it (its job cancelled, `pruned at step N: …`).
2. launch (a second transaction): while fewer than `parallel` trial jobs are live (a
   paused trial's is not: it holds no worker, and counting it could leave every slot to
   trials that wait for the ones never started), fewer than
   `max_trials` trials were asked for, and the max_queued quotas (the owner's, the sweep's
   project's) leave room: ask Optuna, set the values into a copy of the base spec, and
   submit it as the owner through the one submit path every job takes (scheduler/submit.py:
   every rule a POST /v1/jobs checks), storing the job and its trial row together. A spec
   the submit refuses (invalid values, a permission the owner lacks, a bundle gone) fails
   that trial at once (no job).
   Once every trial has an outcome the sweep ends: succeeded, or failed when none completed.

A crash anywhere leaves nothing behind: a trial row is written with its job in one
transaction, the Optuna trial it names was asked for before, and every pass first settles
Optuna trials RUNNING without an undecided row. Two schedulers take turns on a sweep (its
row lock), and telling an ended Optuna trial again is skipped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna import Study
from optuna.samplers import BaseSampler, GridSampler
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState
from pydantic import TypeAdapter
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from torchyard.scheduler import space as sp
from torchyard.scheduler import submit, submitchecks
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.jobs import request_cancel
from torchyard.store.models import Job, Sweep, SweepTrial
from torchyard.store.pruning import (
    GO,
    PAUSE,
    halving_verdict,
    halving_why,
    make_pruner,
    rung_field,
)
from torchyard.store.states import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    IllegalTransition,
)
from torchyard.store.sweeps import (
    CANCELLED_TRIAL,
    COMPLETE,
    FAIL,
    PRUNED,
    active_sweep_ids,
    add_trial,
    end_trial,
    finish_sweep,
    lock_sweep,
    new_points,
    optuna_storage,
    trials_with_jobs,
)

log = logging.getLogger(__name__)

SPACE = TypeAdapter(sp.Space)


@dataclass(frozen=True)
class Tell:
    """An outcome to tell Optuna once the pass that decided it has committed."""

    number: int
    outcome: str
    value: float | None = None


def seed_for(base: int, salt: int) -> int:
    """A 32-bit seed from the sweep's seed and `salt` (the trial's number): every ask gets
    its own stream, the same in whichever process asks, before or after a restart."""
    return int(np.random.SeedSequence([base, salt]).generate_state(1)[0])


def make_sampler(sweep: Sweep, space: sp.Space, number: int) -> BaseSampler:
    """The sampler that asks for trial `number`. A grid's order is shuffled by the sweep's
    seed alone, so that every ask walks the same order."""
    if sweep.sampler == "grid":
        return _Grid(sp.grid(space), seed=seed_for(sweep.seed, 0))
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed_for(sweep.seed, number))
    return optuna.samplers.TPESampler(seed=seed_for(sweep.seed, number))


class _Grid(GridSampler):
    """GridSampler that does not stop the study after the last grid point: Study.stop works
    only inside optimize(); the controller stops at the grid's size itself."""

    def after_trial(self, *args: Any, **kwargs: Any) -> None:
        return None


class SweepController:
    """Runs passes for one scheduler process; its Optuna storage (one small engine) is
    opened at the first sweep it sees."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.db_url = settings.db_url
        self._storage: RDBStorage | None = None
        self._studies: dict[str, Study] = {}

    def run_pass(self) -> int:
        """One pass over every sweep with work; returns how many trial jobs it queued. A
        sweep whose pass fails is logged and tried again next tick; the others go on."""
        with session_scope(self.db_url) as s:
            ids = active_sweep_ids(s)
        started = 0
        for sweep_id in ids:
            try:
                started += self.step(sweep_id)
            except Exception as e:
                trace = not isinstance(e, DBAPIError)  # an outage: one line a tick
                log.warning("sweep %s: pass failed, retried next tick: %s", sweep_id, e,
                            exc_info=trace)  # fmt: skip
                self._studies.pop(sweep_id, None)
        for gone in set(self._studies) - set(ids):
            del self._studies[gone]
        return started

    def step(self, sweep_id: str) -> int:
        """Observe, tell, launch, tell: one sweep's pass."""
        self._tell(sweep_id, self._observe(sweep_id))
        started, tells = self._launch(sweep_id)
        self._tell(sweep_id, tells)
        return started

    # --- Optuna ---------------------------------------------------------------------------------

    def storage(self) -> RDBStorage:
        if self._storage is None:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self._storage = optuna_storage(self.db_url)
        return self._storage

    def study(self, sweep: Sweep) -> Study:
        """The sweep's study (made at its first pass), kept for this process."""
        study = self._studies.get(sweep.id)
        if study is None:
            study = optuna.create_study(
                storage=self.storage(),
                study_name=sweep.id,
                direction="maximize" if sweep.mode == "max" else "minimize",
                pruner=make_pruner(sweep.pruner),
                load_if_exists=True,
            )
            self._studies[sweep.id] = study
        return study

    def _tell(self, sweep_id: str, tells: list[Tell]) -> None:
        """Tell Optuna each outcome; one that fails is told by a later pass (`settle`)."""
        states = {COMPLETE: TrialState.COMPLETE, PRUNED: TrialState.PRUNED, FAIL: TrialState.FAIL,
                  CANCELLED_TRIAL: TrialState.FAIL}  # fmt: skip
        study = self._studies.get(sweep_id)
        if study is None:  # its pass failed: the next pass settles them
            return
        for t in tells:
            value = t.value if t.outcome == COMPLETE else None
            try:
                study.tell(t.number, value, state=states[t.outcome], skip_if_finished=True)
            except Exception as e:
                log.warning("sweep %s: telling trial %d failed, retried next pass: %s",
                            sweep_id, t.number, e)  # fmt: skip

    # --- 1. observe -----------------------------------------------------------------------------

    def _observe(self, sweep_id: str) -> list[Tell]:
        with session_scope(self.db_url) as s:
            sweep = lock_sweep(s, sweep_id)
            if sweep is None:
                return []
            study = self.study(sweep)
            rows = trials_with_jobs(s, sweep.id)
            running = {
                t.number: t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            }
            tells = settle(sweep.id, [t for t, _ in rows], running)
            for trial, job in rows:
                if trial.outcome is None and job is not None:
                    tell = self._follow(s, sweep, study, trial, job, running.get(trial.number))
                    tells += [tell] if tell is not None else []
            paused = [(t, j) for t, j in rows if j is not None and is_paused(t, j)]
            if paused:
                trials = study.get_trials(deepcopy=False)
                for trial, job in paused:
                    tell = decide_paused(s, sweep, trials, trial, job)
                    tells += [tell] if tell is not None else []
            return tells

    def _follow(
        self,
        session: Session,
        sweep: Sweep,
        study: Study,
        trial: SweepTrial,
        job: Job,
        frozen: FrozenTrial | None,
    ) -> Tell | None:
        """One running trial: follow its objective, or record its end."""
        if frozen is None:  # Optuna ended it without us (by hand?): stop the job too
            end_trial(trial, FAIL, error="its Optuna trial was ended outside torchyard")
            _cancel(session, job, "sweep trial ended")
            return None
        follow(session, sweep.metric, trial, job)
        if job.state in TERMINAL:
            return trial_end(trial, job, sweep.metric)
        return None

    # --- 2. launch ------------------------------------------------------------------------------

    def _launch(self, sweep_id: str) -> tuple[int, list[Tell]]:
        with session_scope(self.db_url) as s:
            sweep = lock_sweep(s, sweep_id)
            if sweep is None or sweep.state != RUNNING:
                return 0, []
            rows = trials_with_jobs(s, sweep.id)
            live = sum(
                1
                for t, j in rows
                if j is not None and j.state not in TERMINAL and not is_paused(t, j)
            )
            asked, started, tells = len(rows), 0, []
            while live < sweep.parallel and asked < sweep.max_trials:
                # The submit's own quota rule, asked first: a full queue holds the next trial
                # back (it is not asked for), where a submit would refuse it.
                full = submitchecks.queue_refusal(s, sweep.owner_id, None, sweep.project_id)
                if full is not None:
                    log.info("sweep %s: next trial waits: %s", sweep.id, full.message)
                    break
                trial = self._ask(s, sweep, asked)
                asked += 1
                if trial.job_id is None:
                    tells.append(Tell(trial.number, FAIL))
                else:
                    live, started = live + 1, started + 1
            maybe_finish(sweep, trials_with_jobs(s, sweep.id))
            return started, tells

    def _ask(self, session: Session, sweep: Sweep, asked: int) -> SweepTrial:
        """Ask Optuna for a trial and store it: its job and its row, in this transaction."""
        space = SPACE.validate_python(sweep.space)
        study = self.study(sweep)
        study.sampler = make_sampler(sweep, space, asked)
        asked_trial = study.ask(sp.distributions(space))
        values = sp.decode(space, asked_trial.params)
        name = f"{sweep.name}-{asked_trial.number}"[:200]
        job_id, problem = self.submit_trial(session, sweep, values, name)
        if job_id is None:
            log.info("sweep %s: trial %d failed: %s", sweep.id, asked_trial.number, problem)
            return add_trial(session, sweep, asked_trial.number, values, None, error=problem)
        log.info("sweep %s: trial %d is job %s %s", sweep.id, asked_trial.number, job_id, values)
        return add_trial(session, sweep, asked_trial.number, values, job_id)

    def submit_trial(
        self, session: Session, sweep: Sweep, values: dict[str, Any], name: str
    ) -> tuple[str | None, str | None]:
        """The trial's job, submitted as its owner through the submit service (every rule
        of a POST /v1/jobs) in this transaction; or None and why it was refused."""
        try:
            obj = sp.with_params(sweep.spec, values)
        except sp.PathError as e:
            return None, f"invalid spec: {e}"
        owner = submit.Owner.load(session, sweep.owner_id)
        try:
            done = submit.submit(session, self.settings, owner, obj, name=name, sweep_id=sweep.id)
        except submit.SubmitRefused as e:
            return None, e.message
        return done.job.id, None


def follow(session: Session, metric: str, trial: SweepTrial, job: Job) -> None:
    """The trial's newest point of the objective, shown in its table (the final one once
    its job has ended: the value a complete trial is judged by)."""
    points = new_points(session, job.id, metric, trial.last_step)
    if points:
        trial.last_step, trial.value = points[-1]


def is_paused(trial: SweepTrial, job: Job | None) -> bool:
    """A trial paused at a rung whose job was handed back: held in the queue, on no worker
    (one still stopping holds its worker and counts as live)."""
    return (
        trial.outcome is None
        and trial.paused_rung is not None
        and job is not None
        and job.state == QUEUED
    )


def decide_paused(
    session: Session, sweep: Sweep, trials: list[FrozenTrial], trial: SweepTrial, job: Job
) -> Tell | None:
    """A paused trial decided again (store/pruning.py `halving_verdict`) from what the other
    trials have reported since: released, pruned (told after the commit), or left paused."""
    rung = trial.paused_rung
    assert rung is not None
    frozen = next((t for t in trials if t.number == trial.number), None)
    value = None if frozen is None else frozen.intermediate_values.get(rung)
    if value is None:  # its report is gone (never happens): let it run and report again
        release(trial, job, rung, "its value at the rung was not found")
        return None
    others, could_reach = rung_field(trials, trial.number, rung, sweep.max_trials)
    verdict = halving_verdict(value, others, could_reach, sweep.mode == "max")
    if verdict == PAUSE:
        return None
    if verdict == GO:
        release(trial, job, rung, "in the best third of the trials that reach it")
        return None
    why = halving_why(sweep.metric, value, rung)
    end_trial(trial, PRUNED, value=value if math.isfinite(value) else None)
    trial.paused_rung = None
    _cancel(session, job, f"pruned at step {trial.last_step or 0}: {why}")
    log.info("sweep %s: trial %d pruned at evaluation %d while paused", sweep.id, trial.number,
             rung)  # fmt: skip
    return Tell(trial.number, PRUNED)


def release(trial: SweepTrial, job: Job, rung: int, why: str) -> None:
    """A paused trial goes on: its job's hold cleared (a pass places it; it resumes from
    the checkpoint written at the rung)."""
    trial.paused_rung = None
    job.hold_until = None
    job.pending_reason = f"released at evaluation {rung} ({why}): resumes from its checkpoint"
    log.info("sweep %s: trial %d released at evaluation %d", trial.sweep_id, trial.number, rung)


def settle(sweep_id: str, rows: list[SweepTrial], running: dict[int, Any]) -> list[Tell]:
    """What a crash may have left: Optuna trials RUNNING that have no trial row (asked for,
    never stored: FAIL) or whose row already has an outcome (its tell was lost)."""
    by_number = {t.number: t for t in rows}
    tells = []
    for number in sorted(running):
        row = by_number.get(number)
        if row is None:
            log.warning("sweep %s: Optuna trial %d has no job (the controller stopped "
                        "between asking and storing it): failed", sweep_id, number)  # fmt: skip
            tells.append(Tell(number, FAIL))
        elif row.outcome is not None:
            tells.append(Tell(number, row.outcome, row.value))
    return tells


def trial_end(trial: SweepTrial, job: Job, metric: str) -> Tell:
    """The outcome of a trial whose job ended: complete with its final value when it
    succeeded, cancelled when it was cancelled (by its owner or the sweep's cancel: it says
    nothing about its values, so Optuna is told FAIL), else failed."""
    if job.state == SUCCEEDED:
        if trial.value is not None and math.isfinite(trial.value):
            end_trial(trial, COMPLETE, value=trial.value)
            return Tell(trial.number, COMPLETE, trial.value)
        end_trial(trial, FAIL, error=f"the job succeeded without a finite {metric}")
        return Tell(trial.number, FAIL)
    if job.state == CANCELLED:
        end_trial(trial, CANCELLED_TRIAL, error="its job was cancelled")
        return Tell(trial.number, CANCELLED_TRIAL)
    end_trial(trial, FAIL, error=f"job {job.state}: {job.error or job.state}")
    return Tell(trial.number, FAIL)


def maybe_finish(sweep: Sweep, rows: list[tuple[SweepTrial, Job | None]]) -> None:
    """End a running sweep once all its trials were asked for, have an outcome and their
    jobs have ended (a pruned one's stops after its outcome)."""
    trials = [t for t, _ in rows]
    if len(trials) < sweep.max_trials or any(t.outcome is None for t in trials):
        return
    if any(j is not None and j.state not in TERMINAL for _, j in rows):
        return
    if any(t.outcome == COMPLETE for t in trials):
        finish_sweep(sweep, SUCCEEDED)
    else:
        finish_sweep(sweep, FAILED, "no trial completed (see each trial's error)")


def _cancel(session: Session, job: Job, reason: str) -> bool:
    """Cancel a trial's job if it has not ended; False when it ended first (its end then
    decides the trial)."""
    if job.state in TERMINAL:
        return False
    try:
        request_cancel(session, job, reason=reason)
    except IllegalTransition:
        return False
    return True
