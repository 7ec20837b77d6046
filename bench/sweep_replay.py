"""Recorded unpruned sweeps replayed through pruning rules: what each rule would have cost in
worker-seconds, and which best it would have kept, on the same trials' real curves.

    .venv/bin/python bench/sweep_bench.py --record curves.json    # records them (~30 min)
    .venv/bin/python bench/sweep_replay.py curves.json [--slots 2] [--resume-s 3]
        [--seeds 9,10,11] [--grid]

bench/records/digits-16x30-none-seeds0-11.json holds the unpruned sweeps of seeds 0-11
(`sweep_bench.py --pruners none --seeds 0,...,11`, 16 trials, 30 epochs);
bench/records/digits-16x30-reseeds.json the final values of each seed's winner and of
the trial `sync` keeps, trained with training seeds 0-4 (--reseeded prints the gap of
their means: one run's value is one draw, sd up to ~1 sample).

A model on measurements, not a measurement: each trial's objective curve and epoch time
were measured (the unpruned sweep ran every trial to its end). The replay runs the trials
in their order on --slots slots, each costing its start (as measured) plus its epochs,
and asks a rule at each rung:

- `asha` (what runs today): Optuna's SuccessiveHalvingPruner as store/pruning.py makes it,
  at the rungs of store/pruning.py's `rung_plan`, asked as each trial reaches a rung. It
  decides with what has arrived so far, so a trial that is the best yet at a rung goes on;
- `sync`: synchronous successive halving on the same rungs and reduction: every trial stops
  at a rung until all that will reach it have, and the best max(1, n // reduction) of them
  go on (ties too), each paying --resume-s for a restart from its rung's checkpoint (a cold
  trainer start), with its slot free while it waits. `pruner: halving` is this rule, except
  that it lets a trial go on (or prunes it) without a pause when the decision is already
  certain: this model pauses every trial, so it over-counts halving's restarts.

Per seed: each rule's worker-seconds over the unpruned sweep's, its best complete trial's
final value and the gap to the unpruned best in validation samples (--val-samples), and the
unpruned winner's rank at each rung among all trials: a winner far down at an early rung is
lost by any halving that keeps a third.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import benchlib  # noqa: F401  (the repository root on sys.path)

from torchyard.store.pruning import ASHA_REDUCTION, make_pruner, rung_plan


@dataclass(frozen=True)
class Trial:
    curve: list[float]  # the objective at evaluations 1, 2, … (empty: the trial failed)
    epoch_s: float
    overhead_s: float  # its start and end: worker-seconds beyond its epochs
    failed_s: float  # what a failed trial cost


@dataclass(frozen=True)
class Outcome:
    worker_s: float
    best: float | None  # the best complete trial's final value
    restarts: int = 0
    pick: int | None = None  # that trial's number (where the rule says)


def load(path: Path, overhead_s: float) -> tuple[int, dict[str, list[Trial]]]:
    """The unpruned sweeps of a --record file: (epochs, {seed: trials in order}). A trial's
    overhead is its worker-seconds beyond its epochs at the recorded epoch time, or
    `overhead_s` where no epoch time was recorded."""
    data = json.loads(path.read_text())
    epochs = int(data["epochs"])
    out: dict[str, list[Trial]] = {}
    for seed, sweeps in data["seeds"].items():
        trials = []
        for t in sorted(sweeps["none"], key=lambda t: t["number"]):
            curve = [float(v) for v in t["curve"]]
            spent = float(t["worker_s"])
            if len(curve) < epochs:  # failed (or stopped) before its end: its cost as it was
                trials.append(Trial([], 0.0, 0.0, spent))
                continue
            if t.get("epoch_s"):
                epoch_s = float(t["epoch_s"])
                trials.append(Trial(curve, epoch_s, max(spent - epochs * epoch_s, 0.0), 0.0))
            else:
                trials.append(Trial(curve, (spent - overhead_s) / epochs, overhead_s, 0.0))
        out[seed] = trials
    return epochs, out


def unpruned(trials: list[Trial], epochs: int) -> Outcome:
    spent = sum(t.failed_s or t.overhead_s + epochs * t.epoch_s for t in trials)
    done = [i for i, t in enumerate(trials) if t.curve]
    pick = max(done, key=lambda i: trials[i].curve[-1]) if done else None
    return Outcome(spent, trials[pick].curve[-1] if pick is not None else None, pick=pick)


def replay_asha(trials: list[Trial], epochs: int, slots: int) -> Outcome:
    """Optuna's pruner asked at each rung as the trials reach them, in time order."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    plan = rung_plan("asha", "objective")
    assert plan is not None
    study = optuna.create_study(direction="maximize", pruner=make_pruner("asha"))
    queue = list(range(len(trials)))
    running: list[tuple[float, int, int, int]] = []  # (time, order, trial index, epoch)
    asked: dict[int, optuna.Trial] = {}
    started: dict[int, float] = {}
    spent, finals = 0.0, []

    def launch(now: float) -> None:
        if queue:
            i = queue.pop(0)
            asked[i], started[i] = study.ask(), now
            first = trials[i].failed_s or trials[i].overhead_s + trials[i].epoch_s
            heapq.heappush(running, (now + first, i, i, 1))

    for _ in range(slots):
        launch(0.0)
    while running:
        now, _, i, epoch = heapq.heappop(running)
        t, trial = trials[i], asked[i]
        if not t.curve:
            study.tell(trial, state=TrialState.FAIL)
        elif plan.is_rung(epoch) and epoch < epochs:
            trial.report(t.curve[epoch - 1], epoch)
            if trial.should_prune():
                study.tell(trial, state=TrialState.PRUNED)
            else:
                heapq.heappush(running, (now + t.epoch_s, i, i, epoch + 1))
                continue
        elif epoch < epochs:
            heapq.heappush(running, (now + t.epoch_s, i, i, epoch + 1))
            continue
        else:
            study.tell(trial, t.curve[-1])
            finals.append(t.curve[-1])
        spent += now - started[i]
        launch(now)
    return Outcome(spent, max(finals, default=None))


@dataclass(frozen=True)
class Schedule:
    """Synchronous halving's knobs: the first rung, the reduction between rungs, and the
    fewest trials any rung lets go on."""

    min_resource: int = 1
    reduction: int = ASHA_REDUCTION
    floor: int = 1

    def rungs(self, epochs: int) -> list[int]:
        out, r = [], self.min_resource
        while r < epochs:
            out.append(r)
            r *= self.reduction
        return out

    def keep(self, n: int) -> int:
        return min(n, max(self.floor, n // self.reduction))

    def __str__(self) -> str:
        return f"min {self.min_resource} r {self.reduction} floor {self.floor}"


def replay_sync(
    trials: list[Trial], epochs: int, resume_s: float, schedule: Schedule = Schedule()
) -> Outcome:
    """Synchronous halving: all that reach a rung wait there; the best keep(n) go on."""
    rungs = schedule.rungs(epochs)
    alive = [i for i, t in enumerate(trials) if t.curve]
    spent = sum(t.failed_s + t.overhead_s for t in trials)
    restarts, reached = 0, 0
    for rung in [*rungs, epochs]:
        spent += sum((rung - reached) * trials[i].epoch_s for i in alive)
        if rung == epochs:
            break
        keep = schedule.keep(len(alive))
        cut = sorted((trials[i].curve[rung - 1] for i in alive), reverse=True)[keep - 1]
        going = [i for i in alive if trials[i].curve[rung - 1] >= cut]
        if len(alive) > 1:  # a lone trial never waits: it goes on at once
            restarts += len(going)
            spent += resume_s * len(going)
        alive, reached = going, rung
    pick = max(alive, key=lambda i: trials[i].curve[-1])
    return Outcome(spent, trials[pick].curve[-1], restarts, pick)


def reseeded_gap(draws: dict[str, list[int]], winner: int | None, pick: int | None) -> str:
    """', gap of the means …' where `draws` (correct samples per training seed, by trial
    number) holds both trials; '' otherwise."""
    if winner is None or pick is None:
        return ""
    if winner == pick:
        return ", the same trial"
    a, b = draws.get(str(winner)), draws.get(str(pick))
    if not a or not b:
        return ""
    gap = sum(a) / len(a) - sum(b) / len(b)
    return f", gap of the means over {len(a)} training seeds {gap:+.1f} samples"


def winner_ranks(trials: list[Trial], epochs: int) -> str:
    """The unpruned winner's rank (1 = best) among all trials at each rung."""
    plan = rung_plan("asha", "objective")
    assert plan is not None
    done = [t for t in trials if t.curve]
    win = max(done, key=lambda t: t.curve[-1])
    ranks = []
    for rung in [r for r in plan.rungs if r < epochs]:
        ahead = sum(1 for t in done if t.curve[rung - 1] > win.curve[rung - 1])
        ranks.append(f"{ahead + 1} at {rung}")
    return f"winner's rank of {len(done)}: " + ", ".join(ranks)


def grid(args: argparse.Namespace, epochs: int, seeds: dict[str, list[Trial]]) -> int:
    """Every schedule of the grid on every seed, best first: seeds met (gap <= one
    validation sample and <= 0.3x worker-seconds), the worst ratio and the worst gap."""
    rows = []
    for m, r, f in itertools.product((1, 2, 3), (2, 3, 4), (1, 2, 3)):
        sched = Schedule(m, r, f)
        met, ratios, gaps, missed = 0, [], [], []
        for seed, trials in seeds.items():
            base = unpruned(trials, epochs)
            assert base.best is not None
            o = replay_sync(trials, epochs, args.resume_s, sched)
            ratio = o.worker_s / base.worker_s
            gap = round((base.best - (o.best or 0.0)) * args.val_samples, 3)
            ratios.append(ratio)
            gaps.append(gap)
            if ratio <= 0.3 and gap <= 1.0:
                met += 1
            else:
                missed.append(seed)
        rows.append((met, -max(ratios), sched, max(ratios), max(gaps), missed))
    rows.sort(key=lambda row: (row[0], row[1]), reverse=True)
    print(f"{len(seeds)} seeds; schedule: seeds met, worst ratio, worst gap (samples), missed")
    for met, _, sched, worst, gap, missed in rows:
        print(f"  {sched!s:<22} {met:>2}  {worst:.3f}x  {gap:4.1f}  {','.join(missed)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("curves", type=Path, help="a file written by sweep_bench.py --record")
    p.add_argument("--slots", type=int, default=2, help="trials at once (the sweep's parallel)")
    p.add_argument(
        "--overhead-s",
        type=float,
        default=0.7,
        help="a trial's start and end, where the record has no epoch times",
    )
    p.add_argument("--resume-s", type=float, default=3.0, help="a restart from a checkpoint")
    p.add_argument(
        "--val-samples", type=int, default=359, help="digits' validation set (a fifth of 1797)"
    )
    p.add_argument("--seeds", help="only these recorded seeds (e.g. ones held out of a choice)")
    p.add_argument(
        "--reseeded",
        type=Path,
        help="trials trained again with other training seeds (bench/records/"
        "digits-16x30-reseeds.json): where it holds both sync's pick and the unpruned "
        "winner, the gap of their means too",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="synchronous halving over first rungs 1-3, reductions 2-4, floors 1-3: per "
        "schedule, the seeds where it keeps the best within one sample at <= 0.3x",
    )
    args = p.parse_args()
    epochs, seeds = load(args.curves, args.overhead_s)
    reseeded = json.loads(args.reseeded.read_text())["seeds"] if args.reseeded else {}
    if args.seeds:
        wanted = set(args.seeds.split(","))
        seeds = {k: v for k, v in seeds.items() if k in wanted}
    print(f"{epochs} epochs, {args.slots} slots, restart {args.resume_s} s; worker-seconds "
          "modelled from each trial's measured epoch time and start")  # fmt: skip
    if args.grid:
        return grid(args, epochs, seeds)
    for seed, trials in seeds.items():
        base = unpruned(trials, epochs)
        assert base.best is not None
        print(f"seed {seed}: {len(trials)} trials, unpruned {base.worker_s:.1f} worker-s, best "
              f"{base.best:.5f}; {winner_ranks(trials, epochs)}")  # fmt: skip
        rules = {
            "asha": replay_asha(trials, epochs, args.slots),
            "sync": replay_sync(trials, epochs, args.resume_s),
        }
        for name, o in rules.items():
            gap = (base.best - (o.best or 0.0)) * args.val_samples
            print(f"  {name:>4}: {o.worker_s / base.worker_s:.3f}x worker-seconds, best "
                  f"{o.best:.5f}, gap {gap:.1f} validation samples"
                  + (f", {o.restarts} restarts" if name == "sync" else "")
                  + reseeded_gap(reseeded.get(seed, {}), base.pick, o.pick))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
