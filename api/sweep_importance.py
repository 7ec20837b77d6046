"""Parameter importances of a sweep (GET /v1/sweeps/{id}/importances): Optuna's fANOVA over
the complete trials of the sweep's study (store/sweeps.py: `optuna_storage`, the study named
by the sweep's id), seeded so that the same trials always give the same fractions.

Blocking (Optuna's storage reads and the forest's fit): the route calls it in a worker
thread. Optuna is imported on first use, so an API that never shows importances never
loads it. Fewer than two complete trials, or trials that do not differ (every parameter,
or every value, the same), have no importances: the answer says why instead of showing
Optuna's even split, which would look like a finding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchyard.store.sweeps import optuna_storage

if TYPE_CHECKING:
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

MIN_TRIALS = 2
_MAX_STORAGES = 4  # one per database URL; more only in tests, which make a database each
_storages: dict[str, RDBStorage] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Importances:
    """`importances`: parameter -> fraction (summing to 1, largest first), or empty with
    `reason`; `trials`: the complete trials they were computed from."""

    importances: dict[str, float] = field(default_factory=dict)
    trials: int = 0
    reason: str | None = None


def storage(db_url: str) -> RDBStorage:
    """The process's Optuna storage for `db_url`, made once: making one checks Optuna's
    schema version, too slow to do per request."""
    with _lock:
        found = _storages.get(db_url)
        if found is None:
            if len(_storages) >= _MAX_STORAGES:
                oldest = next(iter(_storages))
                _storages.pop(oldest).engine.dispose()
            found = _storages[db_url] = optuna_storage(db_url)
        return found


def _why_not(trials: list[FrozenTrial]) -> str | None:
    """Why these complete trials have no importances, or None when they have."""
    if len(trials) < MIN_TRIALS:
        return f"needs at least {MIN_TRIALS} complete trials (has {len(trials)})"
    if all(len({repr(t.params.get(name)) for t in trials}) < 2 for name in trials[0].params):
        return "every complete trial has the same parameter values"
    if len({t.value for t in trials}) < 2:
        return "every complete trial has the same objective value"
    return None


def sweep_importances(db_url: str, sweep_id: str) -> Importances:
    """The importances of the sweep's parameters for its objective (the caller has checked
    that the user may see the sweep)."""
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=sweep_id, storage=storage(db_url))
    except KeyError:  # the controller has not made the study yet
        return Importances(reason=_why_not([]))
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reason = _why_not(done)
    if reason is not None:
        return Importances(trials=len(done), reason=reason)
    evaluator = FanovaImportanceEvaluator(seed=0)  # its forest is random: same trials, same answer
    found: dict[str, Any] = get_param_importances(study, evaluator=evaluator)
    return Importances({name: float(v) for name, v in found.items()}, trials=len(done))
