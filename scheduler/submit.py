"""The pool's admission: the one path every job enters the pool through, whatever asked for
it (POST /v1/jobs, the checks of a sweep's specs at POST /v1/sweeps, the trials the sweep
controller queues, any later entry point). Parse, check every rule (submitchecks.py: the
spec, the server, the permissions, the quota; submitrefs.py: the bundle, its script, the
`init` job), store, and say whether the scheduler must be woken; the warnings of a stored
job. A refusal is a `SubmitRefused` and nothing is stored.

Two stages, so that the API checks on its read sessions and stores on its write sessions:
`Admission.admit` (every rule but the quota) gives an `Admitted`, and only an `Admitted` is
stored (`enqueue`: the quota, then the job, in the caller's transaction). `submit` is both
on one session.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from torchyard.contracts import datasets
from torchyard.contracts import spec as job_spec
from torchyard.scheduler import submitchecks as rules
from torchyard.scheduler import submitrefs as refs
from torchyard.scheduler.space import Param
from torchyard.scheduler.submitchecks import Problems, SubmitRefused, Submitter
from torchyard.settings import Settings
from torchyard.storage import storage_for
from torchyard.store.jobs import IdempotencyConflict, Placement, create_job
from torchyard.store.models import Job, User

__all__ = [
    "Admission",
    "Admitted",
    "Owner",
    "SubmitRefused",
    "Submitted",
    "Submitter",
    "enqueue",
    "submit",
    "warnings",
]


@dataclass(frozen=True)
class Owner:
    """A submitter read from the store: a sweep's owner, for its trials."""

    id: int
    is_admin: bool
    can_run_code: bool

    @classmethod
    def load(cls, session: Session, user_id: int) -> Owner:
        user = session.get(User, user_id)
        if user is None:
            raise LookupError(f"no user {user_id}")
        return cls(user.id, user.is_admin, user.can_run_code)


@dataclass(frozen=True)
class Admitted:
    """A spec that passed every rule but the quota, and who submitted it."""

    who: Submitter
    spec: job_spec.JobSpec
    project_id: int | None  # None: the submitter's personal project


@dataclass(frozen=True)
class Submitted:
    """A stored job. `created` False: the job first stored with this Idempotency-Key."""

    job: Job
    created: bool
    spec: job_spec.JobSpec

    @property
    def wake(self) -> bool:
        """Whether the scheduler must be woken: a new queued job."""
        return self.created


class Admission:
    """The checks of one submitter's specs on one session. Each distinct set of references
    (bundle, script, `init`) is looked up once: a sweep checks many specs that share them."""

    def __init__(self, session: Session, settings: Settings, who: Submitter):
        self.session, self.settings, self.who = session, settings, who
        self._refs: dict[str, Problems] = {}

    def check(self, obj: Any) -> tuple[job_spec.JobSpec | None, Problems]:
        """Every problem of a decoded spec at once (no spec: it did not parse); raises
        SubmitRefused (forbidden) for what the submitter may not do."""
        spec, problems = rules.spec_problems(obj, self.settings)
        if spec is None:
            return None, problems
        for refusal in (
            rules.code_refusal(self.who, spec),
            rules.priority_refusal(self.who, spec),
            rules.max_priority_refusal(self.session, self.who, spec.priority),
        ):
            if refusal is not None:
                raise refusal
        return spec, problems + self._reference_problems(spec)

    def check_sweep(self, base: Any, space: Mapping[str, Param]) -> None:
        """Raise SubmitRefused (forbidden) for what no trial of the sweep may do, over the
        space's reachable values together (each trial is checked again at its submit)."""
        refusal = rules.sweep_refusal(self.session, self.who, base, space)
        if refusal is not None:
            raise refusal

    def admit(self, obj: Any) -> Admitted:
        """The spec admitted, or SubmitRefused (invalid: every problem; forbidden)."""
        spec, problems = self.check(obj)
        if spec is None or problems:
            raise SubmitRefused.invalid(problems)
        return Admitted(self.who, spec, self.project_id(spec.project))

    def project_id(self, name: str | None) -> int | None:
        """The project a job goes into (SubmitRefused if the submitter may not)."""
        return rules.project_of(self.session, self.who, name)

    def _reference_problems(self, spec: job_spec.JobSpec) -> Problems:
        if not refs.needs_store(spec):
            return []
        parts = (spec.code, spec.entrypoint, spec.init)
        key = json.dumps([p.model_dump(mode="json") if p else None for p in parts])
        if key not in self._refs:
            self._refs[key] = refs.reference_problems(
                self.session, storage_for(self.settings), self.who, spec
            )
        return self._refs[key]


def enqueue(
    session: Session,
    admitted: Admitted,
    *,
    key: str | None = None,
    name: str | None = None,
    sweep_id: str | None = None,
    rerun_of: str | None = None,
) -> Submitted:
    """Store an admitted spec as a queued job in the caller's transaction (the caller
    commits): SubmitRefused over the user's or the project's `max_queued` quota, or for an Idempotency-Key used with
    another spec. `name`: the spec's display name unless given; `sweep_id`: its sweep;
    `rerun_of`: the job it re-runs. The spec's `tags` and `notes` become the job's (which
    PATCH changes later), not part of its stored spec."""
    who, spec = admitted.who, admitted.spec
    refusal = rules.queue_refusal(session, who.id, key, admitted.project_id)
    if refusal is not None:
        raise refusal
    stored = job_spec.spec_to_dict(spec)
    tags, notes = stored.pop("tags", None) or [], stored.pop("notes", None)
    placed = Placement(admitted.project_id, tuple(dict.fromkeys(tags)), notes, rerun_of)
    try:
        job, created = create_job(
            session,
            who.id,
            stored,
            name=name or spec.display_name,
            idempotency_key=key,
            sweep_id=sweep_id,
            placed=placed,
        )
    except IdempotencyConflict as e:
        raise SubmitRefused("idempotency_conflict", str(e), details={"job_id": e.job_id}) from None
    return Submitted(job, created, spec)


def submit(
    session: Session,
    settings: Settings,
    who: Submitter,
    obj: Any,
    *,
    key: str | None = None,
    name: str | None = None,
    sweep_id: str | None = None,
) -> Submitted:
    """Admit and store on one session (the caller commits)."""
    admitted = Admission(session, settings, who).admit(obj)
    return enqueue(session, admitted, key=key, name=name, sweep_id=sweep_id)


def warnings(session: Session, settings: Settings, spec: job_spec.JobSpec) -> Problems:
    """What a stored job is allowed but likely not meant: the spec's (a batch size above the
    training set) and the pool's (a world size the workers registered now cannot give)."""
    found = datasets.size_warnings(spec, settings.data)
    return found + rules.pool_warnings(session, settings, spec.world_size)
