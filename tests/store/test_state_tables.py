"""The state tables of contracts/states.py are consistent (every state has a row, terminal
states have no exits, the job table is closed over JobState), and they allow every state
change the store's code makes (listed below with where it is made)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import pytest

from torchyard.contracts.states import (
    ATTEMPT_ACTIVE,
    ATTEMPT_COUNTED,
    ATTEMPT_TRANSITIONS,
    JOB_ACTIVE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    WORKER_LIVE,
    WORKER_TRANSITIONS,
    AttemptState,
    JobState,
    WorkerState,
    can_transition,
    state_lists,
)
from torchyard.store import states as store_states

A, W = AttemptState, WorkerState
Table = dict[Any, frozenset[Any]]
TABLES: list[tuple[type[StrEnum], Table]] = [
    (JobState, JOB_TRANSITIONS),
    (AttemptState, ATTEMPT_TRANSITIONS),
    (WorkerState, WORKER_TRANSITIONS),
]

# What store/ does to an attempt's state (audited by hand: a new change in the code needs
# its row here, and in ATTEMPT_TRANSITIONS).
STORE_ATTEMPT_CHANGES = {
    (A.STARTING, A.RUNNING): "lifecycle.mark_started",
    # lifecycle._end_attempt: an active attempt ends with the outcome the caller names
    # (the supervisor's decision; attempts.lose_attempt / hand_back_*; workers.py)
    **{(a, end): "lifecycle.finish_attempt" for a in ATTEMPT_ACTIVE for end in (
        A.SUCCEEDED, A.FAILED, A.LOST, A.HANDED_BACK, A.CANCELLED)},
}  # fmt: skip
# ... and to a worker's (same-state writes, such as re-registering an idle worker, are
# not transitions).
STORE_WORKER_CHANGES = {
    (W.IDLE, W.BUSY): "queue.py: a scheduling pass claims idle workers",
    (W.BUSY, W.IDLE): "workers.release_worker, release_orphaned_workers, register_worker",
    (W.LOST, W.IDLE): "workers.release_worker (a lost worker shows it is alive), register_worker",
    (W.STOPPED, W.IDLE): "workers.register_worker",
    (W.IDLE, W.STOPPED): "workers.stop_accepting, deregister",
    (W.BUSY, W.STOPPED): "workers.deregister",
    (W.LOST, W.STOPPED): "workers.deregister",
    (W.IDLE, W.LOST): "workers.reap_stale_workers, expire_unclaimed",
    (W.BUSY, W.LOST): "workers.reap_stale_workers, expire_unclaimed",
}


@pytest.mark.parametrize(("enum", "table"), TABLES, ids=["job", "attempt", "worker"])
def test_every_state_has_a_row_and_every_exit_is_a_state(enum: type[StrEnum], table: Table) -> None:
    assert set(table) == set(enum), "one row per state"
    for state, exits in table.items():
        assert type(state) is enum
        assert all(type(e) is enum for e in exits), (state, exits)
        assert state not in exits, f"{state} → {state} is not a transition"


def test_the_job_table() -> None:
    assert {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED} == JOB_TERMINAL
    assert all(not JOB_TRANSITIONS[s] for s in JOB_TERMINAL)
    assert set(JobState) - JOB_TERMINAL >= JOB_ACTIVE
    assert JobState.QUEUED not in JOB_ACTIVE
    # every state is reached from queued, and every state can still end
    seen, todo = {JobState.QUEUED}, [JobState.QUEUED]
    while todo:
        for nxt in JOB_TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(JobState)
    for s in set(JobState) - JOB_TERMINAL:
        assert JOB_TRANSITIONS[s] & JOB_TERMINAL or any(
            JOB_TRANSITIONS[n] & JOB_TERMINAL for n in JOB_TRANSITIONS[s]
        ), s


def test_the_attempt_and_worker_tables() -> None:
    ends = {s for s, exits in ATTEMPT_TRANSITIONS.items() if not exits}
    assert ends == set(AttemptState) - ATTEMPT_ACTIVE
    assert ends >= ATTEMPT_COUNTED
    assert AttemptState.HANDED_BACK not in ATTEMPT_COUNTED
    for s in ATTEMPT_ACTIVE:
        assert ends <= ATTEMPT_TRANSITIONS[s], f"an active attempt may end in any way ({s})"
    # a worker never ends for good: a lost or stopped one registers again
    assert all(WORKER_TRANSITIONS[s] for s in WorkerState)
    assert {WorkerState.IDLE, WorkerState.BUSY} == WORKER_LIVE


@pytest.mark.parametrize(
    ("table", "changes"),
    [(ATTEMPT_TRANSITIONS, STORE_ATTEMPT_CHANGES), (WORKER_TRANSITIONS, STORE_WORKER_CHANGES)],
    ids=["attempt", "worker"],
)
def test_the_tables_allow_what_the_store_does(table: Table, changes: dict[Any, str]) -> None:
    missing = [f"{a} → {b} ({where})" for (a, b), where in changes.items() if b not in table[a]]
    assert not missing, "the table lacks transitions the store makes: " + "; ".join(missing)
    made = set(changes)
    unused = [f"{a} → {b}" for a, exits in table.items() for b in exits if (a, b) not in made]
    assert not unused, "transitions no code makes: " + "; ".join(unused)


def test_can_transition_reads_the_job_table() -> None:
    for a in JobState:
        for b in JobState:
            assert can_transition(a.value, b.value) == (b in JOB_TRANSITIONS[a])
    assert not can_transition("queued", "nonsense") and not can_transition("nonsense", "queued")


def test_the_served_lists_match_the_tables() -> None:
    lists = json.loads(json.dumps(state_lists()))  # plain JSON
    assert lists["job"]["states"] == [s.value for s in JobState]
    assert set(lists["job"]["terminal"]) == JOB_TERMINAL
    assert {k: set(v) for k, v in lists["job"]["transitions"].items()} == {
        k.value: set(v) for k, v in JOB_TRANSITIONS.items()
    }
    assert set(lists["attempt"]["counted"]) == ATTEMPT_COUNTED
    assert set(lists["worker"]["live"]) == WORKER_LIVE


def test_the_store_names_are_the_contracts() -> None:
    assert tuple(JobState) == store_states.STATES
    assert store_states.TERMINAL is JOB_TERMINAL and store_states.ACTIVE is JOB_ACTIVE
    assert store_states.TRANSITIONS is JOB_TRANSITIONS
    assert set(store_states.W_LIVE) == WORKER_LIVE
