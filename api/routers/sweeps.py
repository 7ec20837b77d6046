"""Create, list, show and cancel hyperparameter sweeps, and show their parameter importances
(api/sweep_importance.py). A sweep's trials are ordinary jobs of its owner, queued by the
scheduler's sweep controller (scheduler/sweeps.py).

At create time the base spec and every bound and choice of the space, each value set alone
into the base spec, are checked by the submit service's checks (scheduler/submit.py:
`Admission`, every rule a job submit checks but the quota, as the controller submits each
trial through it): a problem names the parameter's field (`space.optimizer.lr.low`), a
refusal (403) is answered by api/errors.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import (
    CurrentUser,
    Principal,
    ReadSessionDep,
    SessionDep,
    SettingsDep,
    actor_of,
)
from torchyard.api.errors import not_found, responses, validation_error
from torchyard.api.jsonlimits import decode_body
from torchyard.api.lanes import run_checks, too_many_builds
from torchyard.api.roles import require_role
from torchyard.api.sweep_importance import sweep_importances
from torchyard.api.sweep_schemas import (
    ImportancesOut,
    SweepIn,
    SweepList,
    SweepOut,
    input_problems,
)
from torchyard.broker import app as broker
from torchyard.contracts import spec as job_spec
from torchyard.contracts.specerrors import MAX_LISTED, without_excess_unknown
from torchyard.scheduler import modelsize, submit
from torchyard.scheduler import space as sp
from torchyard.settings import Settings
from torchyard.store.audit import Actor, record
from torchyard.store.bundles import sweep_bundles, touch_bundles
from torchyard.store.jobs import BadCursor
from torchyard.store.models import Sweep
from torchyard.store.sweeps import (
    SWEEP_STATES,
    NewSweep,
    cancel_sweep,
    create_sweep,
    get_sweep,
    list_sweeps,
    sweep_view,
)

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])
Problems = list[tuple[str, str]]
# What torchyard's own loop records; a script job may log any name.
LOOP_METRICS = ("train/loss", "train/lr", "train/samples_per_s", "val/loss", "val/accuracy")


def _inlined(schema: Any, defs: dict[str, Any]) -> Any:
    """A JSON schema with its `#/$defs/…` references replaced by what they name: inside the
    OpenAPI document such a reference would point at the document's root."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inlined(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inlined(v, defs) for v in schema]
    return schema


_SCHEMA = SweepIn.model_json_schema()
CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _inlined(_SCHEMA, _SCHEMA.get("$defs", {}))}},
    }
}


def _corner_problems(check: submit.Admission, base: dict[str, Any], space: sp.Space) -> Problems:
    """Each bound and choice set alone into the base spec, checked. Past the request's
    budget of model builds (api/lanes.py), 422 naming the parameter that went over it."""
    problems: Problems = []
    for path, field, value in sp.iter_corner_params(space):
        try:
            _, found = check.check(sp.with_params(base, {path: value}))
        except sp.PathError as e:
            problems.append((f"space.{path}", str(e)))
            continue
        except modelsize.TooManyBuilds as e:
            raise validation_error([(f"space.{path}", too_many_builds(e.bound))], "sweep") from None
        problems += [_corner_problem(path, field, f, m) for f, m in found]
    return list(dict.fromkeys(problems))


def _corner_problem(path: str, field: str, f: str, m: str) -> tuple[str, str]:
    """A problem of a spec built with one value, named by what is wrong: the path itself
    (an unknown field, or one crossing a field that is not an object), else the value."""
    if m.startswith("unknown field") and (f == path or path.startswith(f + ".")):
        hint = m.removeprefix("unknown field")  # " (did you mean …?)", when one is close
        return f"space.{path}", f"{f} is not a field of the job spec{hint}"
    if path.startswith(f + "."):
        return f"space.{path}", f"cannot be set: {f}: {m}"
    return f"space.{path}.{field}", f"makes an invalid spec: {f}: {m}"


def _space_problems(s: SweepIn) -> Problems:
    problems: Problems = []
    for path, p in s.space.items():
        for f, m in sp.param_problems(path, p):
            problems.append((".".join(filter(None, ["space", path, f])), m))
    if s.sampler == "grid":
        problems += [(f"space.{f}", m) for f, m in sp.grid_problems(s.space)]
        if not problems and sp.grid_size(s.space) > sp.MAX_GRID:
            problems.append(("space", f"the grid has more than {sp.MAX_GRID} points"))
    return problems


def _objective_problems(s: SweepIn, spec: job_spec.JobSpec) -> Problems:
    if spec.entrypoint is None and s.objective.metric not in LOOP_METRICS:
        return [("objective.metric", f"torchyard's loop records only {', '.join(LOOP_METRICS)}")]
    if spec.entrypoint is not None and s.pruner == "halving":
        # A paused trial resumes from the checkpoint torchyard's loop writes at the rung; a
        # script's state is its own, so it would start over from its last checkpoint.
        return [("pruner", "halving pauses trials at rungs and resumes them from torchyard's "
                 "checkpoint: a script job cannot be paused; use asha or median")]  # fmt: skip
    return []


def _decoded(raw: bytes, settings: Settings) -> SweepIn:
    """The request body as a sweep, or 422 (not JSON, nested too deep, not a sweep)."""
    obj = decode_body(raw, settings.max_json_depth, "sweep")
    bounded, dropped = without_excess_unknown(SweepIn, obj)  # keeps pydantic's call short
    try:
        return SweepIn.model_validate(bounded)
    except ValidationError as e:
        problems = input_problems(e)
        if len(problems) + dropped > MAX_LISTED:  # 50,000 unknown fields: say how many
            more = ("body", f"and {len(problems) + dropped - MAX_LISTED} more problems")
            problems = [*problems[:MAX_LISTED], more]
        raise validation_error(problems, "sweep") from None


def _checked(
    factory: sessionmaker[Session], settings: Settings, user: Principal, raw: bytes
) -> NewSweep:
    """The sweep to store, or 422 naming every problem (SubmitRefused: what the user may not
    do, such as run code without the permission). Blocking: a worker thread's."""
    s = _decoded(raw, settings)
    with factory() as session:
        check = submit.Admission(session, settings, user)
        spec, problems = check.check(s.spec)
        check.check_sweep(s.spec, s.space)  # priority and preemptible over every trial
        problems = [(f"spec.{f}", m) for f, m in problems] + _space_problems(s)
        if spec is not None and not problems:
            problems = _objective_problems(s, spec) + _corner_problems(check, s.spec, s.space)
    if problems or spec is None:
        raise validation_error(problems, "sweep")
    with factory() as session:
        project_id = submit.Admission(session, settings, user).project_id(spec.project)
    trials = min(s.trials, sp.grid_size(s.space)) if s.sampler == "grid" else s.trials
    space = {k: p.model_dump(mode="json") for k, p in s.space.items()}
    return NewSweep(
        name=s.name or f"{spec.display_name}-sweep",
        spec=s.spec,
        space=space,
        metric=s.objective.metric,
        mode=s.objective.mode,
        max_trials=trials,
        parallel=s.parallel,
        sampler=s.sampler,
        pruner=s.pruner,
        seed=spec.seed if s.seed is None else s.seed,
        project_id=project_id,
    )


def _store(
    factory: sessionmaker[Session], user: Principal, new: NewSweep, actor: Actor
) -> SweepOut:
    with factory() as session:
        sweep = create_sweep(session, user.id, new)
        touch_bundles(session, sweep_bundles(new.spec, new.space))  # kept past the retention
        _record_sweep(session, actor, "sweep.create", sweep, trials=new.max_trials)
        session.commit()
        return _out(session, user, sweep.id)


def _record_sweep(
    session: Session, actor: Actor, action: str, sweep: Sweep, **details: Any
) -> None:
    """An audit entry for a change of `sweep`, in the caller's transaction."""
    details = {"name": sweep.name, "project_id": sweep.project_id, **details}
    record(session, actor, action, f"sweep:{sweep.id}", details, project_id=sweep.project_id)


def _out(session: Session, user: Principal, sweep_id: str) -> SweepOut:
    view = sweep_view(session, user.viewer, sweep_id)
    if view is None:
        raise not_found("sweep")
    return SweepOut.model_validate(view)


@router.post(
    "",
    status_code=201,
    response_model=SweepOut,
    summary="Start a sweep",
    description="Checks the base spec and every bound and choice of the space as a job "
    "submit would (422 naming each field, e.g. `space.optimizer.lr.low`; 403 for what the "
    "user may not submit: code without the permission, a priority above 0 with preemptible: "
    "false from a non-admin), stores the sweep and wakes the scheduler, whose sweep controller "
    "then queues the trials as jobs of the user, `parallel` at a time. Choices that each "
    "make a `torchvision/<name>` model not counted before are built to be counted: at most "
    "TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST per sweep (422 naming the parameter), a user's "
    "submits building at once at most TORCHYARD_MAX_MODEL_CHECKS_PER_USER (429).",
    responses=responses(401, 403, 413, 422, 429, 503),
    openapi_extra=CREATE_BODY,
)
async def create_sweep_route(
    request: Request, user: CurrentUser, settings: SettingsDep, background: BackgroundTasks
) -> SweepOut:
    raw = await request.body()
    # Decoding and every check are CPU work bounded by the body's size and the builds'
    # budget: off the event loop, on the checks' own threads (api/lanes.py).
    new = await run_checks(
        request, user.id, _checked, request.app.state.read_sessions, settings, user, raw
    )
    actor = actor_of(request, user)
    out = await run_in_threadpool(_store, request.app.state.sessions, user, new, actor)
    background.add_task(broker.wake_scheduler, settings)
    return out


@router.get(
    "",
    response_model=SweepList,
    summary="List sweeps",
    description="Newest first, without their trials; admins see every user's. Follow "
    "`next_cursor` for more.",
    responses=responses(401, 422, 503),
)
def list_sweeps_route(
    user: CurrentUser,
    session: ReadSessionDep,
    state: Annotated[str | None, Query(description="only sweeps in this state")] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> SweepList:
    if state is not None and state not in SWEEP_STATES:
        raise validation_error([("state", f"unknown state {state!r}; one of {SWEEP_STATES}")])
    try:
        items, next_cursor = list_sweeps(
            session, user.viewer, states=[state] if state else None, cursor=cursor, limit=limit
        )
    except BadCursor as e:
        raise validation_error([("cursor", str(e))]) from None
    return SweepList.model_validate({"items": items, "next_cursor": next_cursor})


@router.get(
    "/{sweep_id}",
    response_model=SweepOut,
    summary="Show a sweep",
    description="Its state, every trial (job, values, state, objective value, pruned) and "
    "the best complete trial.",
    responses=responses(401, 404, 503),
)
def get_sweep_route(sweep_id: str, user: CurrentUser, session: ReadSessionDep) -> SweepOut:
    return _out(session, user, sweep_id)


def _importances(
    factory: sessionmaker[Session], db_url: str, user: Principal, sweep_id: str
) -> ImportancesOut:
    """Blocking: a worker thread's. The session is closed before Optuna's reads start."""
    with factory() as session:
        if get_sweep(session, user.viewer, sweep_id) is None:
            raise not_found("sweep")
    found = sweep_importances(db_url, sweep_id)
    return ImportancesOut(importances=found.importances, trials=found.trials, reason=found.reason)


@router.get(
    "/{sweep_id}/importances",
    response_model=ImportancesOut,
    summary="Parameter importances",
    description="How much of the objective's variance each parameter explains, over the "
    "complete trials (Optuna's fANOVA, seeded: the same trials give the same fractions). "
    "With fewer than 2 complete trials, or trials that do not differ, `importances` is "
    "empty and `reason` says why.",
    responses=responses(401, 404, 503),
)
async def importances_route(
    sweep_id: str, request: Request, user: CurrentUser, settings: SettingsDep
) -> ImportancesOut:
    # Optuna's reads and the forest's fit take up to seconds: off the event loop.
    factory = request.app.state.read_sessions
    return await run_in_threadpool(_importances, factory, settings.db_url, user, sweep_id)


@router.post(
    "/{sweep_id}/cancel",
    status_code=202,
    response_model=SweepOut,
    summary="Cancel a sweep",
    description="No new trial starts; trials queued are cancelled at once, running ones "
    "stop (their checkpoints are kept). Idempotent. Needs the role member or owner in "
    "the sweep's project (a viewer gets 403).",
    responses=responses(401, 403, 404, 503),
)
def cancel_sweep_route(
    sweep_id: str,
    request: Request,
    user: CurrentUser,
    session: SessionDep,
    settings: SettingsDep,
    background: BackgroundTasks,
) -> SweepOut:
    sweep = get_sweep(session, user.viewer, sweep_id)
    if sweep is None:
        raise not_found("sweep")
    require_role(session, user, sweep.project_id, "member", "cancel a sweep")
    changed = cancel_sweep(session, sweep)
    if changed:  # cancelling an ended sweep changes nothing
        _record_sweep(session, actor_of(request, user), "sweep.cancel", sweep)
    session.commit()
    if changed:
        background.add_task(broker.wake_scheduler, settings)
    return _out(session, user, sweep_id)
