"""The states of a job, an attempt and a worker, as enums with their transition tables: the
one list every part reads (the store checks every job change against `JOB_TRANSITIONS`, the
API types its responses with the enums, the SDK and the dashboard take their lists from
here). Adding a state means this file, the store's transition code and the docs; the
dashboard's copy, `web/src/states.gen.js`, is regenerated from this file:
`python -m torchyard.contracts.states --js web/src/states.gen.js`.

Members are `StrEnum`s: they compare equal to, and serialise as, their plain names
(`JobState.QUEUED == "queued"`), so database columns, JSON and old clients see strings."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Any


class JobState(StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    CANCELLING = "cancelling"
    """Cancel asked while starting or running; the trainer is being stopped."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    # back to queued: a lost or handed-back attempt, retried with attempt + 1
    JobState.STARTING: frozenset(
        {
            JobState.RUNNING,
            JobState.QUEUED,
            JobState.FAILED,
            JobState.CANCELLING,
            JobState.CANCELLED,
        }
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.CANCELLING}
    ),
    # the trainer may finish or fail before the cancel reaches it
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
JOB_TERMINAL = frozenset(s for s, nxt in JOB_TRANSITIONS.items() if not nxt)
"""States a job never leaves."""
JOB_ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CANCELLING})
"""States in which a job holds workers (an attempt is under way)."""


class AttemptState(StrEnum):
    """One try at running a job."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    """Its worker died or went silent, or its trainer was killed by a signal."""
    HANDED_BACK = "handed_back"
    """Stopped through no fault of the job (a stopping worker, a preemption): not counted."""
    CANCELLED = "cancelled"


_ATTEMPT_ENDS = frozenset(
    {
        AttemptState.SUCCEEDED,
        AttemptState.FAILED,
        AttemptState.LOST,
        AttemptState.HANDED_BACK,
        AttemptState.CANCELLED,
    }
)
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.STARTING: frozenset({AttemptState.RUNNING}) | _ATTEMPT_ENDS,
    AttemptState.RUNNING: _ATTEMPT_ENDS,
    **{s: frozenset() for s in _ATTEMPT_ENDS},
}
ATTEMPT_ACTIVE = frozenset({AttemptState.STARTING, AttemptState.RUNNING})
ATTEMPT_COUNTED = frozenset({AttemptState.FAILED, AttemptState.LOST})
"""Attempt ends that count against a job's max_restarts (a hand-back does not)."""


class WorkerState(StrEnum):
    IDLE = "idle"
    """Registered, heartbeating, holding no assignment: may be assigned."""
    BUSY = "busy"
    """Holds an assignment."""
    LOST = "lost"
    """Heartbeat stale (or a claim missed): no work until it registers again."""
    STOPPED = "stopped"
    """Deregistered, or stopping: no new work."""


# Re-registering (any state → idle) and deregistering (any state → stopped) also write the
# state a worker is already in: a same-state write is not a transition.
WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.IDLE: frozenset({WorkerState.BUSY, WorkerState.LOST, WorkerState.STOPPED}),
    WorkerState.BUSY: frozenset({WorkerState.IDLE, WorkerState.LOST, WorkerState.STOPPED}),
    # a lost or stopped worker comes back only by registering again
    WorkerState.LOST: frozenset({WorkerState.IDLE, WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.IDLE}),
}
WORKER_LIVE = frozenset({WorkerState.IDLE, WorkerState.BUSY})


def can_transition(from_state: str, to_state: str) -> bool:
    """Whether the job table allows `from_state` → `to_state` (plain names accepted)."""
    try:
        return JobState(to_state) in JOB_TRANSITIONS.get(JobState(from_state), frozenset())
    except ValueError:
        return False


def state_lists() -> dict[str, dict[str, Any]]:
    """Every state list, as plain JSON: what the API serves at `GET /v1/states` for clients
    that must not hard-code them (the dashboard, the SDK)."""
    return {
        "job": {
            "states": [s.value for s in JobState],
            "terminal": sorted(JOB_TERMINAL),
            "active": sorted(JOB_ACTIVE),
            "transitions": {s.value: sorted(n) for s, n in JOB_TRANSITIONS.items()},
        },
        "attempt": {
            "states": [s.value for s in AttemptState],
            "active": sorted(ATTEMPT_ACTIVE),
            "counted": sorted(ATTEMPT_COUNTED),
        },
        "worker": {"states": [s.value for s in WorkerState], "live": sorted(WORKER_LIVE)},
    }


def js_module() -> str:
    """`state_lists()` as an ES module for the dashboard (`web/src/states.gen.js`): per kind
    (JOB, ATTEMPT, WORKER) its members by name, `<KIND>_STATES` in order, and each other
    list as a Set (`JOB_TERMINAL`, …); the job table as `JOB_TRANSITIONS`."""
    enums = {"job": JobState, "attempt": AttemptState, "worker": WorkerState}
    lines = [
        "// Generated from contracts/states.py: do not edit. Regenerate with",
        "// python -m torchyard.contracts.states --js web/src/states.gen.js",
        "",
    ]
    for kind, lists in state_lists().items():
        k = kind.upper()
        names = {s.name: s.value for s in enums[kind]}
        lines.append(f"export const {k} = Object.freeze({json.dumps(names)});")
        for key, value in lists.items():
            if key == "states":
                lines.append(f"export const {k}_STATES = Object.freeze({json.dumps(value)});")
            elif key == "transitions":
                lines.append(f"export const {k}_TRANSITIONS = Object.freeze({json.dumps(value)});")
            else:
                lines.append(f"export const {k}_{key.upper()} = new Set({json.dumps(value)});")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """`--js [PATH]`: the dashboard's module to PATH (else stdout); `--json`: `state_lists()`."""
    if argv[:1] == ["--json"] and len(argv) == 1:
        sys.stdout.write(json.dumps(state_lists(), indent=2) + "\n")
    elif argv[:1] == ["--js"] and len(argv) <= 2:
        text = js_module()
        if len(argv) == 2:
            with open(argv[1], "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    else:
        sys.stderr.write("usage: python -m torchyard.contracts.states --js [PATH] | --json\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
