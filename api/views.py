"""Store rows to response bodies (the tables never leave the store as they are).

Every route that answers with one job builds it from `store.jobs.job_snapshot`'s row
(`job_out`); the list builds its summaries from the same columns (`job_summary`).

A job's reasons (pending, its attempts', its error) are shown as its owner may see them,
whoever asks (`owner_reason`): the scheduler writes them for operators, naming other users'
jobs (preemption) and other users' and projects' names and usage (fair share). Those become
"another job" and "users who used less" (or "projects and users who used less"); an admin
sees the full reasons in GET /v1/queue. The body stays one function of the job's version,
as its ETag promises.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

from torchyard.api.schemas import JobOut, JobSummary
from torchyard.store.models import Job

# Bump when a body's shape changes, so no client keeps a 304 for an older rendering.
BODY_REVISION = "3"  # 2: reasons as the owner may see them; 3: sweep_id and pruned

_JOB_COLUMNS = (
    "id", "name", "state", "attempt", "spec", "pending_reason", "error", "created_at",
    "updated_at", "started_at", "finished_at", "priority", "world_size", "max_restarts",
    "cancel_requested", "notes", "archived_at", "rerun_of", "sweep_id",
)  # fmt: skip


_ID = r"[0-9a-f]{32}"
# Other jobs, as the scheduler and the worker name them: "job <id>", "preempted by <id>",
# "<id> (priority N)" (store/attempts.py, store/lifecycle.py, scheduler/preemption.py,
# worker/outcome.py).
_OTHER_JOB = re.compile(rf"\bjob ({_ID})\b|(?<=\bby )({_ID})\b|\b({_ID})(?= \(priority )")
_WAITING = re.compile(rf"waiting for preempted jobs? ((?:{_ID})(?:, {_ID})*) to stop")
# scheduler/fairshare.py: wait_prefix
_FAIR = re.compile(
    r"^fair share: (?P<me>.*?) has used (?P<used>[0-9.]+ .+?-h(?: \(share [^)]*\))?), "
    r".*\(half-life (?P<hl>[^)]*)\); "
)


def owner_reason(text: str | None, job_id: str, owner: str | None = None) -> str | None:
    """`text` (a reason about the job `job_id` of `owner`) without other users' job ids,
    names or usage: what the job's owner may read. Without `owner`, the name the fair-share
    prefix opens with is taken as the owner's (the scheduler always names the job's owner,
    or its team project as `project NAME`, there)."""
    if not text:
        return text
    fair = _FAIR.match(text)
    # The scheduler names the job's own project first when projects were compared: that
    # part is the job's to see, the other project or user is not.
    team = fair is not None and fair["me"].startswith("project ")
    if fair is not None and (team or fair["me"] == (owner or fair["me"])):
        who = "projects and users" if team else "users"
        text = (
            f"fair share: {fair['me']} has used {fair['used']}; {who} who used less go "
            f"first (half-life {fair['hl']}); " + text[fair.end() :]
        )
    text = _WAITING.sub(lambda m: _waiting(m[1].count(",") + 1), text)

    def other(m: re.Match[str]) -> str:
        return m[0] if (m[1] or m[2] or m[3]) == job_id else "another job"

    return _OTHER_JOB.sub(other, text)


def _waiting(n: int) -> str:
    return (
        "waiting for a preempted job to stop"
        if n == 1
        else f"waiting for {n} preempted jobs to stop"
    )


def _summary_fields(
    get: Callable[[str], Any], owner: str, project: str | None, pruned: bool
) -> dict[str, Any]:
    progress = get("progress")
    job_id = get("id")
    tags = get("tags")
    return {
        **{k: get(k) for k in _JOB_COLUMNS},
        "project": project,
        "tags": tags if isinstance(tags, list) else [],
        "archived": get("archived_at") is not None,
        "pending_reason": owner_reason(get("pending_reason"), job_id, owner),
        "error": owner_reason(get("error"), job_id, owner),
        # progress is the trainer's JSON: anything but an object shows as null
        "progress": progress if isinstance(progress, dict) else None,
        "owner": owner,
        "pruned": bool(pruned),  # store.jobs.pruned_trial
    }


def job_summary(job: Job, owner: str, project: str | None, pruned: bool = False) -> JobSummary:
    """A listed job, from its row (the list has no attempts or metrics); `pruned`: it is a
    trial its sweep's pruner stopped (store.jobs.pruned_jobs)."""
    fields = _summary_fields(lambda k: getattr(job, k), owner, project, pruned)
    return JobSummary.model_validate(fields)


def job_out(row: Mapping[str, Any]) -> JobOut:
    """The one job body (submit, show, cancel), from store.jobs.job_snapshot's row."""
    return JobOut.model_validate(
        {
            **_summary_fields(row.__getitem__, row["owner"], row["project"], row["pruned"]),
            "latest_metrics": row["latest_metrics"],
            "attempts": [
                {**a, "reason": owner_reason(a.get("reason"), row["id"], row["owner"])}
                for a in row["attempts"]
            ],
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
