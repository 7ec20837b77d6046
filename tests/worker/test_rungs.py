"""The worker's side of a sweep trial's rungs (worker/rungs.py, worker/runfiles.py): each rung
of the plan answered once, in order, with the pruner's verdict written where the trainer
waits; what the trainer writes beyond its plan ignored; a store error asked again later;
and the verdict written without following a link the trainer planted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from torchyard.contracts import exitcodes
from torchyard.contracts.eventmodel import RungEvent
from torchyard.contracts.rungs import PAUSED_AT, RungPlan, RungVerdict, verdict_file
from torchyard.worker import rungs as worker_rungs
from torchyard.worker.outcome import STOP_PAUSED, STOP_PRUNED, Ending, decide
from torchyard.worker.runfiles import remove_run_files, write_run_file
from torchyard.worker.rungs import Rungs


class FakePruning:
    """Our own seam (store/pruning.py Pruning): prunes at `prune_at`, pauses at `pause_at`,
    fails `fail` times."""

    def __init__(self, prune_at: int | None = None, fail: int = 0, pause_at: int | None = None):
        self.prune_at, self.pause_at, self.fail, self.asked = prune_at, pause_at, fail, []

    def decide(self, job_id: str, index: int, value: float | None, step: int) -> RungVerdict:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the store is out of reach")
        self.asked.append((index, value, step))
        if index == self.pause_at:
            return RungVerdict(index=index, prune=False, pause=True, reason="others to come")
        prune = index == self.prune_at
        return RungVerdict(index=index, prune=prune, reason="behind" if prune else "")


def rung(index: int, step: int, value: float = 0.5) -> RungEvent:
    return RungEvent(type="rung", index=index, step=step, name="val/accuracy", value=value)


def keeper(tmp_path: Path, pruning: Any) -> Rungs:
    plan = RungPlan(metric="val/accuracy", rungs=[1, 3, 9])
    return Rungs(pruning, tmp_path, "job", plan)


def read(tmp_path: Path, index: int) -> RungVerdict:
    return RungVerdict.model_validate_json((tmp_path / verdict_file(index)).read_bytes())


def test_each_rung_of_the_plan_is_answered_once_and_the_rest_ignored(tmp_path: Path) -> None:
    pruning = FakePruning()
    k = keeper(tmp_path, pruning)
    pending = [rung(1, 10), rung(2, 20), rung(1, 10, 0.9), rung(3, 30), rung(10**6, 40)]
    assert k.answer(pending) is None and pending == []
    assert pruning.asked == [(1, 0.5, 10), (3, 0.5, 30)]  # not 2 nor 10**6, and 1 once
    assert read(tmp_path, 1) == RungVerdict(index=1, prune=False)
    assert not (tmp_path / verdict_file(2)).exists()


def test_a_prune_ends_the_answers_and_says_where(tmp_path: Path) -> None:
    k = keeper(tmp_path, FakePruning(prune_at=3))
    pending = [rung(1, 10), rung(3, 30), rung(9, 90)]
    done = k.answer(pending)
    assert done is not None and (done.step, done.verdict.prune, done.verdict.reason) == (
        30, True, "behind")  # fmt: skip
    assert read(tmp_path, 3).prune and pending == [] and not (tmp_path / verdict_file(9)).exists()


def test_a_store_error_leaves_the_rung_for_a_later_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_rungs, "ASK_AGAIN_S", 0.0)
    pruning = FakePruning(fail=2)
    k = keeper(tmp_path, pruning)
    pending = [rung(1, 10)]
    assert k.answer(pending) is None and len(pending) == 1 and not pruning.asked
    assert k.answer(pending) is None and len(pending) == 1
    assert k.answer(pending) is None and pending == [] and read(tmp_path, 1).index == 1


def test_the_verdict_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    target.write_text("the worker's own file")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / verdict_file(1)).symlink_to(target)
    write_run_file(run_dir, verdict_file(1), b'{"index": 1, "prune": false}')
    assert target.read_text() == "the worker's own file"
    assert not (run_dir / verdict_file(1)).is_symlink()
    assert os.stat(run_dir / verdict_file(1)).st_mode & 0o777 == 0o644
    assert [p.name for p in run_dir.iterdir()] == [verdict_file(1)]  # no temporary left
    (run_dir / "rung-2.json").symlink_to(target)
    remove_run_files(run_dir, "rung-", ".json")
    assert list(run_dir.iterdir()) == [] and target.exists()


def test_a_pruned_trials_attempt_is_cancelled_with_the_pruners_reason() -> None:
    base = {"rank": 0, "worker_id": "w", "job_state": "cancelling", "last_step": 30}
    why = "pruned at step 30: val/accuracy 0.5 at evaluation 3 is not in the best third"
    d = decide(Ending(rc=exitcodes.PRUNED, stop_why=STOP_PRUNED, prune_reason=why, **base))  # type: ignore[arg-type]
    assert d is not None and (d.outcome, d.reason, d.retryable) == ("cancelled", why, False)
    # Exit 76 that the worker did not ask for (user code can exit 76): an ordinary failure.
    forged = decide(Ending(rc=exitcodes.PRUNED, stop_why=None, **{**base, "job_state": "running"}))  # type: ignore[arg-type]
    assert forged is not None and forged.outcome == "failed"


def test_a_pause_is_the_workers_alone_and_hands_the_attempt_back(tmp_path: Path) -> None:
    """Synchronous halving: a paused trial's verdict is never written for the trainer (it
    would read it as go on); the worker stops it as for a preemption and hands it back."""
    k = keeper(tmp_path, FakePruning(pause_at=3))
    pending = [rung(1, 10), rung(3, 30), rung(9, 90)]
    done = k.answer(pending)
    assert done is not None and done.verdict.pause and done.step == 30 and pending == []
    assert read(tmp_path, 1).index == 1 and not (tmp_path / verdict_file(3)).exists()
    why = f"{PAUSED_AT}30: others to come"
    base = {"rank": 0, "worker_id": "w", "job_state": "running", "last_step": 30}
    d = decide(
        Ending(rc=exitcodes.PREEMPTED, stop_why=STOP_PAUSED, prune_reason=why, stopped=True, **base)
    )  # type: ignore[arg-type]
    assert d is not None and (d.outcome, d.reason, d.retryable) == ("handed_back", why, False)
