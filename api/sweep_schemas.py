"""Request and response bodies of the sweep routes (api/routers/sweeps.py). The search
space's parameters are scheduler/space.py's models, shared with the controller."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from torchyard.contracts.states import JobState
from torchyard.scheduler.space import MAX_PARAMS, Param

SAMPLERS = ("random", "tpe", "grid")
PRUNERS = ("none", "median", "asha", "halving")
_TAGS = ("float", "int", "categorical")


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str = Field(min_length=1, max_length=100, description="e.g. val/accuracy")
    mode: Literal["min", "max"]


class SweepIn(BaseModel):
    """POST /v1/sweeps."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(
        default=None, min_length=1, max_length=180, pattern=r"^[\w.\- ]+$",
        description="display name; trial jobs are named `<name>-<trial number>`",
    )  # fmt: skip
    spec: dict[str, Any] = Field(description="the base job spec each trial starts from")
    space: dict[str, Param] = Field(
        min_length=1, max_length=MAX_PARAMS,
        description="dotted spec path -> {type: float|int|categorical, ...}",
    )  # fmt: skip
    objective: Objective
    trials: int = Field(ge=1, le=1000, description="trials to run in all (a grid's size at most)")
    parallel: int = Field(default=1, ge=1, le=64, description="trials running at most at once")
    sampler: Literal["random", "tpe", "grid"] = "tpe"
    pruner: Literal["none", "median", "asha", "halving"] = Field(
        default="none",
        description="asha: Optuna's asynchronous successive halving (decides at once); "
        "halving: synchronous successive halving (a trial waits at a rung, its worker freed, "
        "until the decision is certain; built-in loop jobs only); median: Optuna's median",
    )
    seed: int | None = Field(
        default=None, ge=0, le=2**63 - 1, description="the sampler's seed (default: spec.seed)"
    )


def input_problems(e: ValidationError) -> list[tuple[str, str]]:
    """pydantic's errors as (field, message), fields as the body names them: a parameter's
    type tag left out (`space.optimizer.lr.low`, not `space.optimizer.lr.float.low`)."""
    problems = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        if len(loc) > 2 and loc[0] == "space" and loc[2] in _TAGS:
            del loc[2]
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc.append("type")
        problems.append((".".join(loc) or "body", str(err["msg"])))
    return problems


class TrialOut(BaseModel):
    model_config = ConfigDict(use_enum_values=True)  # the state as its plain name

    number: int = Field(description="Optuna's trial number")
    job_id: str | None = Field(description="null: its values made an invalid spec (see error)")
    params: dict[str, Any] = Field(description="dotted spec path -> the value tried")
    state: JobState = Field(description="its job's state (failed when it has no job)")
    status: str = Field(
        description="running until decided (paused: waiting at a rung, pruner halving), then "
        "complete, pruned, failed or cancelled"
    )
    paused_at: int | None = Field(
        default=None, description="the evaluation (rung) a paused trial waits at; null: not paused"
    )
    value: float | None = Field(
        description="the objective's newest value: the final one once complete, the value at "
        "its rung once pruned"
    )
    step: int | None = Field(description="the step of that value (where a pruned trial stopped)")
    pruned: bool
    error: str | None


class BestOut(BaseModel):
    number: int
    job_id: str | None
    params: dict[str, Any]
    value: float


class SweepSummary(BaseModel):
    id: str
    name: str
    owner: str
    project: str | None = Field(default=None, description="the project its trials run in")
    state: str = Field(description="running, succeeded, failed, cancelled")
    objective: Objective
    max_trials: int = Field(description="trials to run in all")
    parallel: int
    sampler: str
    pruner: str
    seed: int
    error: str | None
    counts: dict[str, int] = Field(description="trials by status: running, complete, …")
    best: BestOut | None = Field(description="the complete trial with the best final value")
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class SweepOut(SweepSummary):
    spec: dict[str, Any]
    space: dict[str, Any]
    trials: list[TrialOut]


class SweepList(BaseModel):
    items: list[SweepSummary]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null: none")


class ImportancesOut(BaseModel):
    """GET /v1/sweeps/{id}/importances."""

    importances: dict[str, float] = Field(
        description="parameter -> its share of the objective's variance (fANOVA), summing to "
        "1, largest first; empty when the trials cannot tell (see reason)"
    )
    trials: int = Field(description="the complete trials they were computed from")
    reason: str | None = Field(
        default=None, description="why there are none (e.g. fewer than 2 complete trials)"
    )
