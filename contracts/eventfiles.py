"""Where a run's events are written (torch-free: the worker reads these names too).

Rank 0 writes every event to `events.jsonl`; every other rank k writes only its `error`
and `stopped` events to `events.rank<k>.jsonl`, which its own worker reads to classify
how that rank ended (trainer/events.py has the format)."""

from __future__ import annotations

EVENTS_FILE = "events.jsonl"
RANK_EVENTS = frozenset({"error", "stopped"})


def rank_events_file(rank: int) -> str:
    """Where rank `rank` (> 0) writes its own error and stopped events."""
    return f"events.rank{rank}.jsonl"
