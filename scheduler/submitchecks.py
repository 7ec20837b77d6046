"""The rules a submit is checked against, whatever its entry point (scheduler/submit.py runs
them): the spec itself and what only the server knows (the data set on disk or in the object
store, the world size, the model and data-set size limits), the permissions (running one's
own code, a priority above the user's `max_priority`, a priority nobody can preempt, over a
sweep's whole space) and the `max_queued` quotas (the user's and the project's); and the
warnings of a job that is stored all the same (a world size the pool cannot give now). The spec's references (a bundle and its
script, an `init` job) are submitrefs.py's.

Also the words they speak: who submits (`Submitter`) and a refusal (`SubmitRefused`), which
the API maps to its status codes in one place (api/errors.py). Each rule is a function of this
module, called through it, so that one patched rule is seen by every entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from sqlalchemy.orm import Session

from torchyard.contracts import datasets
from torchyard.contracts import spec as job_spec
from torchyard.scheduler import modelsize
from torchyard.scheduler import space as sp
from torchyard.scheduler.policy import Kind, describe_kind, kind_of
from torchyard.settings import Settings
from torchyard.storage import datasets as stored_sets
from torchyard.storage import storage_for
from torchyard.storage.keys import dataset_manifest_key
from torchyard.store import projects
from torchyard.store.jobs import idempotency_key_used
from torchyard.store.queue import live_counts
from torchyard.store.quotas import max_priority_of, over_max_queued
from torchyard.store.workers import stale_cutoff

log = logging.getLogger(__name__)
Problems = list[tuple[str, str]]
MIN_PRIORITY = -1000  # the spec's lowest priority, and the lowest max_priority
# What a refusal is; the API answers 422, 403, 429 and 409 (api/errors.py: `refused`).
Refusal = Literal["invalid", "forbidden", "quota_exceeded", "idempotency_conflict"]


class Submitter(Protocol):
    """Who submits: the API's authenticated principal, or a sweep's owner (submit.Owner)."""

    @property
    def id(self) -> int: ...

    @property
    def is_admin(self) -> bool: ...

    @property
    def can_run_code(self) -> bool: ...


class SubmitRefused(Exception):
    """A submit refused, with nothing stored. `problems`: the (field, message) pairs of an
    invalid spec; `details`: what the API's error body carries."""

    def __init__(
        self, code: Refusal, message: str, *, problems: Problems | None = None, details: Any = None
    ):
        self.code, self.message = code, message
        self.problems, self.details = problems or [], details
        super().__init__(message)

    @classmethod
    def invalid(cls, problems: Problems) -> SubmitRefused:
        """Every problem of a spec at once (the message lists them, one detail each)."""
        listed = "; ".join(f"{f}: {m}" for f, m in problems)
        details = [{"field": f, "message": m} for f, m in problems]
        return cls("invalid", f"invalid spec: {listed}", problems=problems, details=details)


# --- the spec and the server --------------------------------------------------------------------


def spec_problems(obj: Any, settings: Settings) -> tuple[job_spec.JobSpec | None, Problems]:
    """A decoded spec checked before anything touches the store: the spec itself and what
    only the server knows, every problem at once. When the spec does not parse, the
    server's checks still run on the fields that are readable (a world_size above
    TORCHYARD_MAX_WORLD_SIZE is reported beside a batch_size it does not divide)."""
    try:
        spec = job_spec.parse_spec(obj)
    except job_spec.SpecError as e:
        named = {f for f, _ in e.problems}
        extra = [(f, m) for f, m in raw_place_problems(obj, settings) if f not in named]
        return None, e.problems + extra
    problems = place_problems(settings, spec.data.name if spec.data else None, spec.world_size)
    return spec, problems + limit_problems(spec, settings)


def raw_place_problems(obj: Any, settings: Settings) -> Problems:
    """The server's checks of a spec that did not parse, on the fields that have the right
    type (an `entrypoint` job has no data set of torchyard's to look for)."""
    if not isinstance(obj, dict):
        return []
    data = obj.get("data")
    name = data.get("name") if isinstance(data, dict) and "entrypoint" not in obj else None
    world = obj.get("world_size")
    return place_problems(
        settings,
        name if isinstance(name, str) else None,
        world if isinstance(world, int) and not isinstance(world, bool) else None,
    )


def place_problems(settings: Settings, data: str | None, world_size: int | None) -> Problems:
    """The data set is on disk (or, with an object store, in the store: the workers pull
    it); the world size is allowed. (A script job has no `data`: its script reads its own.)"""
    problems = []
    missing = [str(p) for p in datasets.missing_dataset_files(data, settings.data)] if data else []
    if data and missing and not dataset_stored(settings, data):
        problems.append(("data.name", missing_data_message(settings, data, missing)))
    if world_size is not None and world_size > settings.max_world_size:
        problems.append(
            ("world_size", f"must be <= {settings.max_world_size} (TORCHYARD_MAX_WORLD_SIZE)")
        )
    return problems


def dataset_stored(settings: Settings, name: str) -> bool:
    """With an object store: whether it holds the data set `name` (its manifest: one HEAD).
    A store out of reach does not refuse the job (its worker retries the pull)."""
    storage = storage_for(settings)
    if storage.stored_run_dirs or not stored_sets.needs_files(name):
        return False
    try:
        return storage.exists(dataset_manifest_key(name))
    except OSError as e:
        log.warning("data set %s: the store did not answer (%s); accepted unchecked", name, e)
        return True


def missing_data_message(settings: Settings, name: str, missing: list[str]) -> str:
    """What the data.name problem says: where it looked, and how an admin adds the set."""
    where = f"data set '{name}' is not on the server; looked for " + ", ".join(missing)
    storage = storage_for(settings)
    if not storage.stored_run_dirs and stored_sets.needs_files(name):
        where += f", and for {storage.describe(dataset_manifest_key(name))}"
    if name.startswith("imagefolder/"):
        fix = f"torchyard data upload DIR --name {name.partition('/')[2]}"
    else:
        fix = f"torchyard data import {name} FILE…"
    return f"{where} (an admin adds it with `{fix}`)"


def limit_problems(spec: job_spec.JobSpec, settings: Settings) -> Problems:
    """The model and the data set are within the size limits. Each field has its cap but
    their product does not: refuse a model or data set too large for the server before it is
    stored (nothing to clean up, no OOM on a worker). A `torchvision/<name>` model is counted
    on the meta device with its args (modelsize.py); a bundle's model, by the trainer."""
    found = datasets.limit_problems(spec, settings.max_model_params, settings.max_data_bytes)
    return found + modelsize.torchvision_problems(spec, settings.max_model_params)


# --- permissions --------------------------------------------------------------------------------


def code_refusal(who: Submitter, spec: job_spec.JobSpec) -> SubmitRefused | None:
    """A spec that runs the user's own code (a bundle, a script, a `module:function`
    factory) from a user not allowed to: that code runs with the worker's privileges."""
    if not spec.runs_code or who.is_admin or who.can_run_code:
        return None
    return SubmitRefused(
        "forbidden",
        "this job runs its own code (a code bundle, an entrypoint script or a "
        "module:function factory), and this user may not run their own code; an admin "
        "grants it with `torchyard token create --user NAME --can-run-code`",
    )


def priority_refusal(who: Submitter, spec: job_spec.JobSpec) -> SubmitRefused | None:
    """A job that may not be preempted and asks for a priority above 0 from a non-admin: it
    could take workers from everyone and never give them back."""
    return _unpreemptible_refusal(who, spec.priority, spec.preemptible)


def _unpreemptible_refusal(
    who: Submitter, priority: int, preemptible: bool, field: str = "priority", what: str = ""
) -> SubmitRefused | None:
    if preemptible or priority <= 0 or who.is_admin:
        return None
    return SubmitRefused(
        "forbidden",
        f"only admins may give a job with preemptible: false a priority above 0 "
        f"(got priority {priority}{what}); make it preemptible or use priority <= 0",
        details=[{"field": field, "message": "above 0 needs preemptible: true"}],
    )


def max_priority_refusal(
    session: Session, who: Submitter, priority: int, field: str = "priority", what: str = ""
) -> SubmitRefused | None:
    """Priority is a permission: a non-admin's job above the user's max_priority (set by an
    admin with the quota; by default 0, the default priority) is refused, so a user orders
    their own jobs but cannot outrank, and so preempt, other users' work on their own say."""
    if who.is_admin or priority <= MIN_PRIORITY:  # every limit allows the lowest
        return None
    limit = max_priority_of(session, who.id)
    if priority <= limit:
        return None
    return SubmitRefused(
        "forbidden",
        f"priority {priority}{what} is above this user's max_priority, {limit}; use a "
        f"priority <= {limit}, or ask an admin to raise it "
        "(`torchyard quota set USER --max-priority N`)",
        details=[{"field": field, "limit": limit, "message": f"must be <= {limit}"}],
    )


def sweep_refusal(
    session: Session, who: Submitter, base: Any, space: Mapping[str, sp.Param]
) -> SubmitRefused | None:
    """The permissions of a sweep over every trial it can ask for, not only each value
    alone: the space sets each field on its own, so its highest priority can come with
    `preemptible: false` from another parameter (or the base spec). Each trial is checked
    again when the controller submits it."""
    priorities = [
        v
        for v in sp.values_at(space, base, "priority", 0)
        if isinstance(v, int) and not isinstance(v, bool)
    ]
    top = max(priorities, default=0)
    field = "space.priority" if "priority" in space else "spec.priority"
    can_pin = any(v is False for v in sp.values_at(space, base, "preemptible", True))
    what = " with preemptible: false in a trial of this sweep"
    refusal = _unpreemptible_refusal(who, top, not can_pin, field, what)
    if refusal is not None:
        return refusal
    return max_priority_refusal(session, who, top, field, " in a trial of this sweep")


def project_of(session: Session, who: Submitter, name: str | None) -> int | None:
    """The id of the project a job of `who` goes into: `name`, or None for their personal
    project (made when the job is stored, if missing: this may run on a read session).
    A project they have no role in is invalid (422 naming `project`, the same words whether
    it exists or not, so names of others' projects leak nothing); a viewer's is forbidden."""
    if name is None:
        return projects.personal_project_id(session, who.id)
    project = projects.project_named(session, name)
    role = (
        None
        if project is None
        else projects.effective_role(session, who.id, who.is_admin, project.id)
    )
    if project is None or role is None:
        raise SubmitRefused.invalid([("project", f"no project {name!r} that you are in")])
    if not projects.at_least(role, "member"):
        raise SubmitRefused(
            "forbidden",
            f"you are a viewer of project {name!r}: only its members and owners submit to it",
        )
    return project.id


# --- the quota ----------------------------------------------------------------------------------


def queue_refusal(
    session: Session, user_id: int, key: str | None = None, project_id: int | None = None
) -> SubmitRefused | None:
    """The user's queued jobs fill their quota, or the project's queued jobs fill its
    quota, checked in the transaction that would store the job (over_max_queued locks the
    rows, so two submits cannot both take the last place). A retry with a used
    Idempotency-Key stores nothing: not refused (read after the lock, so a concurrent
    first try with that key is seen)."""
    full = over_max_queued(session, user_id, project_id)
    if full is None or (key is not None and idempotency_key_used(session, user_id, key)):
        return None
    detail: dict[str, Any] = {"field": "max_queued", "limit": full.limit}
    if full.project is not None:
        detail["project"] = full.project
    # No `message` in the detail: the message says it all, and clients print both.
    return SubmitRefused("quota_exceeded", full.message, details=[detail])


# --- warnings -----------------------------------------------------------------------------------


def pool_warnings(session: Session, settings: Settings, world_size: int) -> Problems:
    """A world size no group of live workers of one kind can give now: the job is queued all
    the same (workers may register later) and its pending reason will say why it waits.
    No worker at all for a one-worker job is a pool starting up or scaled to zero: no
    warning."""
    kinds: dict[Kind, int] = {}
    for device, name, count in live_counts(
        session, stale_cutoff(session, settings.heartbeat_timeout_s)
    ):
        k = kind_of(device, name)
        kinds[k] = kinds.get(k, 0) + count
    best = max(kinds.values(), default=0)
    if world_size <= best or (not kinds and world_size == 1):
        return []
    registered = ", ".join(f"{c} {describe_kind(k)}" for k, c in sorted(kinds.items(), key=str))
    if len(kinds) > 1:
        have = f"the largest group of one kind registered now, {best} (a job never mixes CPU "
        have += f"and GPU workers or GPU models; registered: {registered})"
    else:
        have = f"the {best} workers registered now ({registered or 'none'})"
    message = f"{world_size} is more than {have}: the job waits in the queue until enough register"
    return [("world_size", message)]
