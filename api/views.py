"""Store rows to response bodies (the tables never leave the store as they are).

Every route that answers with one job builds it from `store.jobs.job_snapshot`'s row
(`job_out`); the list builds its summaries from the same columns (`job_summary`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from torchyard.api.schemas import JobOut, JobSummary
from torchyard.store.models import Job

# Bump when a body's shape changes, so no client keeps a 304 for an older rendering.
BODY_REVISION = "1"

_JOB_COLUMNS = (
    "id", "name", "state", "attempt", "spec", "pending_reason", "error", "created_at",
    "updated_at", "started_at", "finished_at", "priority", "world_size", "max_restarts",
    "cancel_requested",
)  # fmt: skip


def _summary_fields(get: Callable[[str], Any], owner: str) -> dict[str, Any]:
    progress = get("progress")
    return {
        **{k: get(k) for k in _JOB_COLUMNS},
        # progress is the trainer's JSON: anything but an object shows as null
        "progress": progress if isinstance(progress, dict) else None,
        "owner": owner,
    }


def job_summary(job: Job, owner: str) -> JobSummary:
    """A listed job, from its row (the list has no attempts or metrics)."""
    return JobSummary.model_validate(_summary_fields(lambda k: getattr(job, k), owner))


def job_out(row: Mapping[str, Any]) -> JobOut:
    """The one job body (submit, show, cancel), from store.jobs.job_snapshot's row."""
    return JobOut.model_validate(
        {
            **_summary_fields(row.__getitem__, row["owner"]),
            "latest_metrics": row["latest_metrics"],
            "attempts": row["attempts"],
        }
    )


def etag(job_id: str, version: int, *extra: object) -> str:
    """A strong validator for a body that depends only on the job's version and `extra`
    (a request's query parameters), never on who asks."""
    key = repr((BODY_REVISION, job_id, version, extra)).encode()
    return '"' + hashlib.sha256(key).hexdigest()[:32] + '"'


def etag_matches(if_none_match: str | None, tag: str) -> bool:
    """If-None-Match against a strong tag: `*`, or the tag in its comma-separated list
    (W/ prefixes compared weakly, as RFC 9110 says GET must)."""
    if if_none_match is None:
        return False
    candidates = [t.strip() for t in if_none_match.split(",")]
    return "*" in candidates or any(t.removeprefix("W/") == tag for t in candidates)
