"""A sweep trial's stops at its rungs (trainer/rungs.py): the trainer reports the objective
at each rung of its plan and trains no further until the verdict is there; pruned, it
stops where it is (no checkpoint, exit PRUNED); a stop signal while it waits checkpoints
as any stop does; its last evaluation is never a rung."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from trainer_testlib import make_spec, train_in_process

from torchyard.contracts import exitcodes
from torchyard.contracts.rungs import PLAN_FILE, RungPlan, RungVerdict, verdict_file
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.distributed import Dist
from torchyard.trainer.events import MemoryEvents
from torchyard.trainer.loop import Run, run
from torchyard.trainer.signals import StopFlag

SPEC = make_spec(model={"name": "mlp", "hidden": [32]}, epochs=5, batch_size=128,
                 checkpoint={"every_epochs": 1, "keep_last": 5})  # fmt: skip


def plan(run_dir: Path, rungs: list[int], metric: str = "val/accuracy") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PLAN_FILE).write_text(RungPlan(metric=metric, rungs=rungs).model_dump_json())


def verdict(run_dir: Path, index: int, prune: bool, reason: str = "") -> None:
    v = RungVerdict(index=index, prune=prune, reason=reason)
    (run_dir / verdict_file(index)).write_text(v.model_dump_json())


def of(events: MemoryEvents, kind: str) -> list[dict[str, Any]]:
    return [e for e in events.events if e["type"] == kind]


def test_a_pruned_trial_stops_at_its_rung_without_a_checkpoint(tmp_path: Path) -> None:
    plan(tmp_path, [1, 3])
    verdict(tmp_path, 1, prune=False)
    verdict(tmp_path, 3, prune=True, reason="not in the best third")
    code, ev = train_in_process(SPEC, tmp_path)
    assert code == exitcodes.PRUNED
    spe = ev.events[0]["steps_per_epoch"]
    rungs = of(ev, "rung")
    assert [(r["index"], r["step"], r["name"]) for r in rungs] == [
        (1, spe, "val/accuracy"), (3, 3 * spe, "val/accuracy")
    ]  # fmt: skip
    accuracy = [m for m in of(ev, "metric") if m["name"] == "val/accuracy"]
    assert [r["value"] for r in rungs] == [accuracy[0]["value"], accuracy[2]["value"]]
    (stopped,) = of(ev, "stopped")
    assert (stopped["signal"], stopped["step"], stopped["checkpoint"]) == ("pruned", 3 * spe, None)
    assert of(ev, "progress")[-1]["step"] == 3 * spe  # where it stopped, not the last report
    assert [c["step"] for c in of(ev, "checkpoint")] == [spe, 2 * spe]  # none at the rung
    assert not of(ev, "finished") and max(e.get("step", 0) for e in ev.events) == 3 * spe


def test_the_trainer_waits_for_the_verdict(tmp_path: Path) -> None:
    plan(tmp_path, [1])
    ev = MemoryEvents()
    waited: list[float] = []

    def worker() -> None:  # answers 0.5 s after the rung event, as a slow store would
        while not of(ev, "rung"):
            time.sleep(0.01)
        waited.append(time.time())
        time.sleep(0.5)
        verdict(tmp_path, 1, prune=False)

    t = threading.Thread(target=worker)
    t.start()
    code = run(parse_spec(SPEC), _run(tmp_path, ev, StopFlag()))
    t.join()
    assert code == exitcodes.OK and of(ev, "finished")
    after = [e for e in ev.events if e["type"] in ("metric", "progress") and e["time"] >= waited[0]]
    assert after and min(e["time"] for e in after) >= waited[0] + 0.45  # nothing while it waited


def test_a_stop_signal_while_waiting_checkpoints_and_stops(tmp_path: Path) -> None:
    plan(tmp_path, [2])
    ev, stop = MemoryEvents(), StopFlag()

    def signal_when_waiting() -> None:
        while not of(ev, "rung"):
            time.sleep(0.01)
        stop.signal = "SIGTERM"

    t = threading.Thread(target=signal_when_waiting)
    t.start()
    code = run(parse_spec(SPEC), _run(tmp_path, ev, stop))
    t.join()
    assert code == exitcodes.PREEMPTED
    (rung,) = of(ev, "rung")
    (stopped,) = of(ev, "stopped")
    assert stopped["signal"] == "SIGTERM" and stopped["step"] == rung["step"]
    assert stopped["checkpoint"] is not None


def test_the_last_evaluation_is_never_a_rung(tmp_path: Path) -> None:
    plan(tmp_path, [5])  # the spec's 5 epochs: its final evaluation
    code, ev = train_in_process(SPEC, tmp_path)
    assert code == exitcodes.OK and not of(ev, "rung") and of(ev, "finished")


def _run(run_dir: Path, ev: MemoryEvents, stop: StopFlag) -> Run:
    return Run(
        run_dir=run_dir,
        dist=Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")),
        events=ev,
        data_root=run_dir / "no-data",
        stop=stop,
        log=lambda _s: None,
    )
