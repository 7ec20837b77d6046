"""The references a spec makes to things on the server, checked at submit (scheduler/submit.py):
a code bundle and its entrypoint script, another job's weights for `init`.

A reference is checked against what the submitting user may see: a bundle they uploaded, a
job of theirs (admins: any), so that ids of other users' things lead nowhere.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from torchyard.contracts.spec import CodeSpec, EntrypointSpec, InitSpec, JobSpec
from torchyard.scheduler.submitchecks import Problems, Submitter
from torchyard.storage import Storage
from torchyard.store.bundlefiles import archive_key
from torchyard.store.bundles import bundle_names, get_bundle
from torchyard.store.checkpoints import init_checkpoint, list_checkpoints
from torchyard.store.jobs import Viewer, get_job

# Names of the bundle's .py files shown when its entrypoint script is not among them.
SHOWN_SCRIPTS = 10


def needs_store(spec: JobSpec) -> bool:
    """Whether `reference_problems` has anything to look up (most specs do not)."""
    return spec.code is not None or spec.init is not None


def reference_problems(
    session: Session, storage: Storage, who: Submitter, spec: JobSpec
) -> Problems:
    """Every problem with the spec's references, as (field, message) pairs."""
    problems: Problems = []
    if spec.code is not None:
        problems += _bundle_problems(session, storage, who, spec.code, spec.entrypoint)
    if spec.init is not None:
        problems += _init_problems(session, who, spec.init)
    return problems


def _bundle_problems(
    session: Session,
    storage: Storage,
    who: Submitter,
    code: CodeSpec,
    entrypoint: EntrypointSpec | None,
) -> Problems:
    bundle_id = code.bundle
    if get_bundle(session, None if who.is_admin else who.id, bundle_id) is None:
        return [
            (
                "code.bundle",
                f"no bundle {bundle_id} of yours: upload it first (POST /v1/bundles or "
                "`torchyard submit --code DIR`)",
            )
        ]
    names = bundle_names(storage, bundle_id)
    if names is None or not storage.exists(archive_key(bundle_id)):
        return [
            (
                "code.bundle",
                f"bundle {bundle_id} is no longer in the server's storage: upload it again "
                "(POST /v1/bundles or `torchyard submit --code DIR`)",
            )
        ]
    if entrypoint is None or entrypoint.script in names:
        return []
    scripts = [n for n in names if n.endswith(".py")]
    shown = ", ".join(scripts[:SHOWN_SCRIPTS]) + (", …" if len(scripts) > SHOWN_SCRIPTS else "")
    return [
        (
            "entrypoint.script",
            f"no file {entrypoint.script!r} in bundle {bundle_id[:12]}; its Python files: "
            + (shown or "none"),
        )
    ]


def _init_problems(session: Session, who: Submitter, init: InitSpec) -> Problems:
    found = get_job(session, Viewer(who.id, who.is_admin), init.from_job)
    if found is None:
        return [("init.from_job", f"no job {init.from_job} of yours")]
    job = found[0]
    # The worker loads what init_checkpoint picks: recorded, and not pruned by keep_last.
    if init_checkpoint(session, job.id, init.checkpoint) is not None:
        return []
    where = f"job {job.id} ({job.state})"
    if init.checkpoint == "latest":
        message = f"{where} has no weights and no resume checkpoint yet"
    elif init.checkpoint == "weights":
        message = f"{where} has no final weights yet; 'latest' takes its newest checkpoint"
    else:
        kept = list_checkpoints(session, job.id)
        steps = sorted({c.step for c in kept if c.kind == "resume"})
        shown = ", ".join(map(str, steps[-10:])) or "none"
        message = f"{where} has no resume checkpoint of step {init.checkpoint} (steps: {shown})"
    return [("init.checkpoint", message)]
