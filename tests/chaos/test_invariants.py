"""The fault suite's own checks can fail: the overlap detector on hand-made timelines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from invariants import overlaps


def _ev(attempt: int, t: float) -> dict[str, object]:
    return {"type": "metric", "attempt": attempt, "time": t}


def test_overlap_detector() -> None:
    sequential = [_ev(1, 0), _ev(1, 5), _ev(2, 6), _ev(2, 9), _ev(3, 10)]
    assert overlaps(sequential) == []
    # attempt 1 went on writing after attempt 2 had started (a stale trainer)
    assert overlaps([_ev(1, 0), _ev(2, 4), _ev(1, 5), _ev(2, 8)]) == [(1, 2)]
    # a long first attempt spanning two later ones
    assert overlaps([_ev(1, 0), _ev(2, 2), _ev(2, 3), _ev(3, 5), _ev(1, 9)]) == [(1, 2), (1, 3)]
    assert overlaps([{"type": "metric", "time": 1.0}]) == []  # no attempt number: no claim
