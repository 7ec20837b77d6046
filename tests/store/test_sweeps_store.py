"""Sweeps in the store and the sweep controller (scheduler/sweeps.py) against real Optuna, on
SQLite and PostgreSQL: trials queued as jobs with their values set, ASHA's verdicts at the
rungs (store/pruning.py) and a pruned trial's cancel, outcomes, quotas, cancel, two controllers at once, and a
controller that stops between asking Optuna and storing the trial."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select, text, update
from support.db import SPEC, Factory

from torchyard.contracts.rungs import RungVerdict
from torchyard.scheduler import submit
from torchyard.scheduler import sweeps as controller
from torchyard.scheduler.sweeps import SweepController
from torchyard.settings import Settings
from torchyard.store import migrate
from torchyard.store.db import session_scope
from torchyard.store.jobs import Viewer, job_snapshot, pruned_jobs
from torchyard.store.lifecycle import finish_attempt, handback_delay_s
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import (
    PAUSED_HOLD,
    Base,
    Job,
    JobEvent,
    Sweep,
    SweepTrial,
    User,
    WebhookDelivery,
)
from torchyard.store.pruning import GO, PAUSE, PRUNE, Pruning, halving_verdict, rung_plan
from torchyard.store.sweeps import (
    NewSweep,
    cancel_sweep,
    create_sweep,
    get_sweep,
    list_sweeps,
    optuna_url,
    sweep_view,
)
from torchyard.store.webhooks import create_webhook

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

LR_GRID: dict[str, Any] = {"optimizer.lr": {"type": "categorical", "choices": [0.1, 0.01, 0.001]}}


def _head() -> str:
    """The newest revision of torchyard's own migrations (whatever comes after 0007)."""
    (head,) = ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_heads()
    return str(head)


def new_sweep(factory: Factory, owner: str = "alice", **fields: Any) -> str:
    base: dict[str, Any] = {
        "name": "s", "spec": SPEC, "space": LR_GRID, "metric": "val/accuracy", "mode": "max",
        "max_trials": 3, "parallel": 1, "sampler": "grid", "pruner": "none", "seed": 0,
    }  # fmt: skip
    uid = factory.user_id(owner)
    with session_scope(factory.url) as s:
        return create_sweep(s, uid, NewSweep(**(base | fields))).id


def trials(url: str, sweep_id: str) -> list[dict[str, Any]]:
    with session_scope(url) as s:
        view = sweep_view(s, Viewer(0, is_admin=True), sweep_id)
        assert view is not None
        return view["trials"]


def sweep_row(url: str, sweep_id: str) -> Sweep:
    with session_scope(url) as s:
        sweep = s.get(Sweep, sweep_id)
        assert sweep is not None
        return sweep


def run_job(factory: Factory, job_id: str, values: dict[int, float], end: str | None) -> None:
    """A worker's part: the job runs, records val/accuracy at these steps, and ends."""
    with session_scope(factory.url) as s:
        state = s.scalar(select(Job.state).where(Job.id == job_id))
    if state == "queued":
        factory.set_state(job_id, "starting")
        factory.set_state(job_id, "running")
    rows = [{"name": "val/accuracy", "step": k, "epoch": 1.0, "value": v, "time": 1.0}
            for k, v in values.items()]  # fmt: skip
    with session_scope(factory.url) as s:
        ingest_metrics(s, job_id, rows)
    if end is not None:
        factory.set_state(job_id, end)


def study(url: str, sweep_id: str) -> optuna.Study:
    return optuna.load_study(study_name=sweep_id, storage=optuna_url(url))


@pytest.fixture
def ctl(settings: Settings) -> SweepController:
    return SweepController(settings)


def test_trials_are_jobs_with_their_values_at_the_dotted_paths(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    space = {
        "optimizer.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True, "step": None},
        "model.hidden": {"type": "categorical", "choices": [[8], [16, 8]]},
        "batch_size": {"type": "int", "low": 16, "high": 64, "step": 16, "log": False},
    }
    sid = new_sweep(factory, space=space, sampler="tpe", parallel=2, max_trials=4)
    assert ctl.run_pass() == 2
    assert ctl.run_pass() == 0  # two live already
    got = trials(db_url, sid)
    assert [t["number"] for t in got] == [0, 1] and {t["state"] for t in got} == {"queued"}
    with session_scope(db_url) as s:
        for t in got:
            job = s.get(Job, t["job_id"])
            assert job is not None and job.sweep_id == sid and job.name == f"s-{t['number']}"
            p = t["params"]
            assert job.spec["optimizer"]["lr"] == p["optimizer.lr"]
            assert 0.001 <= p["optimizer.lr"] <= 0.3
            assert job.spec["model"]["hidden"] == p["model.hidden"] in ([8], [16, 8])
            assert job.spec["batch_size"] == p["batch_size"] in (16, 32, 48, 64)
            assert job.spec["data"] == SPEC["data"] | job.spec["data"]  # the rest as given
    assert [t.state.name for t in study(db_url, sid).trials] == ["RUNNING", "RUNNING"]


def test_a_space_over_params_sets_each_trials_params(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    """`params.<name>` makes the spec's `params` when the base has none, and keeps the base's
    other params when it has some."""
    grid = {"params.lr": {"type": "categorical", "choices": [0.1, 0.01]}}
    bare = new_sweep(factory, space=grid, max_trials=2, parallel=2)
    given = new_sweep(factory, space=grid, max_trials=2, parallel=2,
                      spec=SPEC | {"params": {"arch": "wide", "lr": 1.0}})  # fmt: skip
    assert ctl.run_pass() == 4
    for sid, rest in ((bare, {}), (given, {"arch": "wide"})):
        seen = []
        for t in trials(db_url, sid):
            with session_scope(db_url) as s:
                job = s.get(Job, t["job_id"])
                assert job is not None and list(t["params"]) == ["params.lr"]
                assert job.spec["params"] == rest | {"lr": t["params"]["params.lr"]}
                seen.append(job.spec["params"]["lr"])
        assert sorted(seen) == [0.01, 0.1]


def test_asha_prunes_at_the_rung_and_the_best_complete_trial_wins(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    """The worker's verdicts (store/pruning.py) at rungs 1, 3, 9 …: the first trial at a
    rung goes on, a trial below the best third there is pruned at once, recorded with its
    value and step and its job cancelled; the controller only records how jobs ended."""
    pruning = Pruning(db_url)
    sid = new_sweep(factory, pruner="asha")
    ctl.run_pass()
    (t0,) = trials(db_url, sid)
    run_job(factory, t0["job_id"], {10: 0.5}, None)
    assert pruning.decide(t0["job_id"], 1, 0.5, 10) == RungVerdict(index=1, prune=False)
    run_job(factory, t0["job_id"], {30: 0.55, 100: 0.6}, None)
    assert not pruning.decide(t0["job_id"], 3, 0.55, 30).prune
    factory.set_state(t0["job_id"], "succeeded")
    ctl.run_pass()  # trial 0 complete with its final value, trial 1 queued
    t0, t1 = trials(db_url, sid)
    assert (t0["status"], t0["value"], t0["step"]) == ("complete", 0.6, 100)
    run_job(factory, t1["job_id"], {10: 0.9, 30: 0.92, 100: 0.95}, "succeeded")
    assert not pruning.decide(t1["job_id"], 1, 0.9, 10).prune  # the best at rung 1
    ctl.run_pass()
    t2 = trials(db_url, sid)[2]
    run_job(factory, t2["job_id"], {10: 0.1}, None)
    v = pruning.decide(t2["job_id"], 1, 0.1, 10)  # below the best third of 0.5, 0.9, 0.1
    assert v.prune and "val/accuracy 0.1 at evaluation 1" in v.reason
    assert pruning.decide(t2["job_id"], 1, 0.1, 10).prune  # asked again: the same answer
    t0, t1, t2 = trials(db_url, sid)
    assert (t1["status"], t1["value"]) == ("complete", 0.95)
    assert (t2["status"], t2["pruned"], t2["state"], t2["value"], t2["step"]) == (
        "pruned", True, "cancelling", 0.1, 10)  # fmt: skip
    with session_scope(db_url) as s:
        data = list(s.scalars(select(JobEvent.data).where(JobEvent.job_id == t2["job_id"])))
    (cancel,) = [d for d in data if d.get("to") == "cancelling"]
    assert cancel["reason"].startswith("pruned at step 10: val/accuracy 0.1 at evaluation 1")
    states = [t.state.name for t in study(db_url, sid).trials]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert sweep_row(db_url, sid).state == "running"  # until the pruned job has stopped
    with session_scope(db_url) as s:
        hook = create_webhook(s, factory.user_id("alice"), None, "http://127.0.0.1:9/h",
                              ["job.cancelled", "sweep.completed"], "s" * 16).id  # fmt: skip
    plain = factory.job("alice", "cancelling")  # cancelled by hand: its webhook fires
    factory.set_state(t2["job_id"], "cancelled")  # the worker stopped it
    factory.set_state(plain, "cancelled")
    ctl.run_pass()
    with session_scope(db_url) as s:
        sent = {(d.subject, d.event) for d in s.scalars(select(WebhookDelivery))
                if d.webhook_id == hook}  # fmt: skip
        assert sent == {(plain, "job.cancelled"), (sid, "sweep.completed")}  # not the trial
        assert pruned_jobs(s, [t0["job_id"], t1["job_id"], t2["job_id"], plain]) == {t2["job_id"]}
        assert job_snapshot(s, Viewer(0, True), t2["job_id"])["pruned"] is True  # type: ignore[index]
        assert job_snapshot(s, Viewer(0, True), plain)["pruned"] is False  # type: ignore[index]
    sweep = sweep_row(db_url, sid)
    assert sweep.state == "succeeded" and sweep.finished_at is not None
    with session_scope(db_url) as s:
        view = sweep_view(s, Viewer(0, True), sid)
    assert view is not None and view["best"] == {
        "number": 1, "job_id": t1["job_id"], "params": {"optimizer.lr": t1["params"]["optimizer.lr"]},
        "value": 0.95,
    }  # fmt: skip
    assert view["counts"] == {"running": 0, "paused": 0, "complete": 2, "pruned": 1,
                              "failed": 0, "cancelled": 0}  # fmt: skip
    assert view["trials"][2]["status"] == "pruned"  # its job's cancel did not change that


def hand_back(db_url: str, factory: Factory, job_id: str, reason: str) -> None:
    """The worker's part when it stopped a paused trial (worker/outcome.py STOP_PAUSED)."""
    with session_scope(db_url) as s:
        number = s.scalar(select(Job.attempt).where(Job.id == job_id))
    aid = factory.attempt(job_id, number=number)
    with session_scope(db_url) as s:
        assert finish_attempt(s, aid, "handed_back", reason=reason) == "queued"


def job_row(db_url: str, job_id: str) -> Job:
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


@pytest.mark.parametrize(
    ("mine", "others", "could_reach", "maximize", "verdict"),
    [
        (0.5, [], 2, True, PAUSE),  # 3 will reach the rung, 1 goes on: anyone may beat it
        (0.9, [0.5], 1, True, PAUSE),
        (0.1, [0.5, 0.9], 0, True, PRUNE),
        (0.9, [0.5, 0.1], 0, True, GO),
        (0.9, [0.5, 0.1, 0.2, 0.3], 2, True, PAUSE),  # keep 2: one better would be enough
        (0.9, [0.5, 0.1, 0.2, 0.3, 0.4], 1, True, GO),  # keep 2, at most one can beat it
        (0.1, [0.5, 0.9, 0.05], 5, True, PAUSE),  # keep 3 of 9: two better, five may come
        (0.1, [0.5, 0.9, 0.8], 2, True, PRUNE),  # keep 2 of 6: three did better already
        (0.2, [0.5, 0.9], 0, False, GO),  # minimise: the lowest goes on
        (float("nan"), [0.1], 0, True, PRUNE),  # not finite: the worst
        (0.5, [0.5, 0.5], 0, True, GO),  # ties go on together
        (0.5, [], 0, True, GO),  # alone at the rung
    ],
)
def test_halving_decides_only_what_the_rest_cannot_change(
    mine: float, others: list[float], could_reach: int, maximize: bool, verdict: str
) -> None:
    assert halving_verdict(mine, others, could_reach, maximize) == verdict


def test_halving_pauses_a_trial_holds_its_job_and_the_controller_settles_it(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    """Synchronous halving: a trial whose verdict the trials to come could change is paused
    (its job handed back and held: no worker, not counted against `parallel`), and each
    controller pass decides it again, releasing the best third and pruning the rest."""
    pruning = Pruning(db_url)
    sid = new_sweep(factory, pruner="halving", max_trials=3, parallel=2)
    assert ctl.run_pass() == 2
    t0, t1 = trials(db_url, sid)
    run_job(factory, t0["job_id"], {10: 0.5}, None)
    v = pruning.decide(t0["job_id"], 1, 0.5, 10)
    assert v.pause and not v.prune and "paused until the trials still running" in v.reason
    hand_back(db_url, factory, t0["job_id"], f"paused at step 10: {v.reason}")
    job0 = job_row(db_url, t0["job_id"])
    assert job0.state == "queued" and job0.hold_until == PAUSED_HOLD
    assert "paused at evaluation 1" in (job0.pending_reason or "")
    with session_scope(db_url) as s:  # a sweep's pause is not a host that fails the job
        assert handback_delay_s(s, t0["job_id"]) == (0, 0.0)
    assert (trials(db_url, sid)[0]["status"], trials(db_url, sid)[0]["paused_at"]) == ("paused", 1)

    assert ctl.run_pass() == 1  # still paused; it holds no slot, so trial 2 starts
    t0, t1, t2 = trials(db_url, sid)
    assert t0["status"] == "paused" and job_row(db_url, t0["job_id"]).hold_until == PAUSED_HOLD
    run_job(factory, t1["job_id"], {10: 0.9}, None)
    assert pruning.decide(t1["job_id"], 1, 0.9, 10).pause  # trial 2 could still beat it
    hand_back(db_url, factory, t1["job_id"], "paused at step 10: …")
    run_job(factory, t2["job_id"], {10: 0.1}, None)
    v2 = pruning.decide(t2["job_id"], 1, 0.1, 10)  # the last to come: the worst of three
    assert v2.prune and "synchronous halving" in v2.reason

    assert ctl.run_pass() == 0
    t0, t1, t2 = trials(db_url, sid)
    assert (t0["status"], t0["value"], t0["step"], t0["paused_at"]) == ("pruned", 0.5, 10, None)
    assert t0["state"] == "cancelled"  # a held job has no worker: cancelled at once
    assert (t1["status"], t1["paused_at"]) == ("running", None)
    job1 = job_row(db_url, t1["job_id"])
    assert job1.state == "queued" and job1.hold_until is None
    assert (job1.pending_reason or "").startswith("released at evaluation 1")
    with session_scope(db_url) as s:
        data = list(s.scalars(select(JobEvent.data).where(JobEvent.job_id == t0["job_id"])))
    (cancel,) = [d for d in data if d.get("to") == "cancelled"]
    assert cancel["reason"].startswith("pruned at step 10: val/accuracy 0.5 at evaluation 1")
    assert [t.state.name for t in study(db_url, sid).trials] == ["PRUNED", "RUNNING", "PRUNED"]

    # Released: asked again at the same rung (a resumed trainer reports it again), it goes
    # on, and Optuna is not told the rung twice (it would warn "already reported").
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pruning.decide(t1["job_id"], 1, 0.9, 10) == RungVerdict(index=1, prune=False)
    run_job(factory, t1["job_id"], {30: 0.95}, "succeeded")
    factory.set_state(t2["job_id"], "cancelled")
    ctl.run_pass()
    sweep = sweep_row(db_url, sid)
    assert sweep.state == "succeeded"
    with session_scope(db_url) as s:
        view = sweep_view(s, Viewer(0, True), sid)
    assert view is not None and view["best"] is not None and view["best"]["number"] == 1
    assert view["counts"] == {"running": 0, "paused": 0, "complete": 1, "pruned": 2,
                              "failed": 0, "cancelled": 0}  # fmt: skip


def test_paused_trials_leave_the_queue_quota_to_the_trials_they_wait_for(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, pruner="halving", max_trials=3, parallel=1)
    with session_scope(db_url) as s:
        s.execute(update(User).where(User.name == "alice").values(max_queued=1))
    assert ctl.run_pass() == 1
    (t0,) = trials(db_url, sid)
    run_job(factory, t0["job_id"], {10: 0.5}, None)
    assert Pruning(db_url).decide(t0["job_id"], 1, 0.5, 10).pause
    hand_back(db_url, factory, t0["job_id"], "paused at step 10: …")
    assert ctl.run_pass() == 1  # queued and held, but not in the way of trial 1
    assert [t["status"] for t in trials(db_url, sid)] == ["paused", "running"]
    assert ctl.run_pass() == 0  # trial 1 queued: the quota is full now


def test_a_paused_trial_of_a_cancelled_sweep_is_cancelled(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, pruner="halving", max_trials=3, parallel=1)
    ctl.run_pass()
    (t0,) = trials(db_url, sid)
    run_job(factory, t0["job_id"], {10: 0.5}, None)
    assert Pruning(db_url).decide(t0["job_id"], 1, 0.5, 10).pause
    hand_back(db_url, factory, t0["job_id"], "paused at step 10: …")
    with session_scope(db_url) as s:
        sweep = s.get(Sweep, sid)
        assert sweep is not None and cancel_sweep(s, sweep)
    ctl.run_pass()
    (t0,) = trials(db_url, sid)
    assert (t0["state"], t0["status"]) == ("cancelled", "cancelled")
    assert sweep_row(db_url, sid).state == "cancelled"


def test_a_trial_that_finished_is_complete_and_the_pruner_never_decides_after(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, pruner="asha", max_trials=1)
    ctl.run_pass()
    (t,) = trials(db_url, sid)
    run_job(factory, t["job_id"], {10: 0.2, 50: 0.3}, "succeeded")
    ctl.run_pass()
    assert not Pruning(db_url).decide(t["job_id"], 1, 0.2, 10).prune  # a late rung: no-op
    (t,) = trials(db_url, sid)
    assert (t["status"], t["state"], t["value"], t["step"]) == ("complete", "succeeded", 0.3, 50)


def test_rung_plans_match_their_pruners() -> None:
    asha = rung_plan("asha", "val/loss")
    assert asha is not None and asha.rungs[:4] == [1, 3, 9, 27] and not asha.every
    assert [asha.is_rung(i) for i in (1, 2, 3, 9, 10)] == [True, False, True, True, False]
    median = rung_plan("median", "val/loss")
    assert median is not None and median.every and median.is_rung(7)
    assert rung_plan("halving", "val/loss") == asha  # the same rungs, decided otherwise
    assert rung_plan("none", "val/loss") is None


def test_failed_jobs_and_invalid_values_fail_trials_and_then_the_sweep(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    space = {"batch_size": {"type": "categorical", "choices": [16, 0]}}
    sid = new_sweep(factory, space=space, max_trials=2, parallel=2)
    ctl.run_pass()
    by_value = {t["params"]["batch_size"]: t for t in trials(db_url, sid)}
    bad = by_value[0]
    assert bad["job_id"] is None and bad["status"] == "failed" and bad["state"] == "failed"
    assert "batch_size: must be >= 1" in bad["error"]
    run_job(factory, by_value[16]["job_id"], {5: 0.3}, "failed")
    ctl.run_pass()
    good = trials(db_url, sid)[by_value[16]["number"]]
    assert good["status"] == "failed" and good["error"].startswith("job failed")
    sweep = sweep_row(db_url, sid)
    assert (sweep.state, sweep.error) == ("failed", "no trial completed (see each trial's error)")
    assert {t.state.name for t in study(db_url, sid).trials} == {"FAIL"}


def test_a_succeeded_job_without_the_metric_fails_its_trial(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, max_trials=1, metric="val/loss", mode="min")
    ctl.run_pass()
    (t,) = trials(db_url, sid)
    run_job(factory, t["job_id"], {10: 0.9}, "succeeded")  # val/accuracy, not val/loss
    ctl.run_pass()
    (t,) = trials(db_url, sid)
    assert t["status"] == "failed" and "without a finite val/loss" in t["error"]


def test_the_quota_holds_trials_back_until_there_is_room(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, parallel=3)
    with session_scope(db_url) as s:
        s.execute(update(User).where(User.name == "alice").values(max_queued=1))
    assert ctl.run_pass() == 1
    assert ctl.run_pass() == 0  # one queued already: max_queued
    factory.set_state(trials(db_url, sid)[0]["job_id"], "starting")
    assert ctl.run_pass() == 1


def test_cancel_stops_queued_and_running_trials_and_no_new_one_starts(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory, parallel=2)
    ctl.run_pass()
    a, b = trials(db_url, sid)
    run_job(factory, a["job_id"], {10: 0.5}, None)
    with session_scope(db_url) as s:
        sweep = get_sweep(s, Viewer(factory.user_id("alice")), sid)
        assert sweep is not None and cancel_sweep(s, sweep)
    with session_scope(db_url) as s:
        sweep = s.get(Sweep, sid)
        assert sweep is not None and not cancel_sweep(s, sweep)  # idempotent
    a, b = trials(db_url, sid)
    assert (a["state"], b["state"]) == ("cancelling", "cancelled")
    assert ctl.run_pass() == 0
    factory.set_state(a["job_id"], "cancelled")
    assert ctl.run_pass() == 0
    got = trials(db_url, sid)
    assert len(got) == 2 and {t["status"] for t in got} == {"cancelled"}
    assert sweep_row(db_url, sid).state == "cancelled"
    assert [t.state.name for t in study(db_url, sid).trials] == ["FAIL", "FAIL"]
    with session_scope(db_url) as s:  # nothing left for the controller
        assert controller.active_sweep_ids(s) == []


def test_a_crash_between_ask_and_insert_leaves_no_trial_running(
    factory: Factory, settings: Settings, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = new_sweep(factory, parallel=2, max_trials=3)

    def crash(*_: Any, **__: Any) -> None:
        raise RuntimeError("killed after asking Optuna, before the job was stored")

    monkeypatch.setattr(submit, "create_job", crash)  # the trial's submit stores its job
    first = SweepController(settings)
    assert first.run_pass() == 0  # the pass failed and was rolled back; the loop goes on
    assert trials(db_url, sid) == []
    assert [t.state.name for t in study(db_url, sid).trials] == ["RUNNING"]
    monkeypatch.undo()
    restarted = SweepController(settings)  # a new scheduler process
    assert restarted.run_pass() == 2
    assert [t.state.name for t in study(db_url, sid).trials] == ["FAIL", "RUNNING", "RUNNING"]
    assert [t["number"] for t in trials(db_url, sid)] == [1, 2]


def test_a_lost_tell_is_told_by_the_next_pass(
    factory: Factory, settings: Settings, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = new_sweep(factory, max_trials=2)
    ctl = SweepController(settings)
    ctl.run_pass()
    run_job(factory, trials(db_url, sid)[0]["job_id"], {10: 0.7}, "succeeded")
    monkeypatch.setattr(SweepController, "_tell", lambda *_: None)  # died after the commit
    ctl.run_pass()
    assert trials(db_url, sid)[0]["status"] == "complete"
    assert [t.state.name for t in study(db_url, sid).trials] == ["RUNNING", "RUNNING"]
    monkeypatch.undo()
    SweepController(settings).run_pass()
    done = study(db_url, sid).trials[0]
    assert (done.state.name, done.value) == ("COMPLETE", 0.7)


def test_two_controllers_at_once_start_each_trial_once(
    factory: Factory, settings: Settings, db_url: str
) -> None:
    sid = new_sweep(factory, sampler="random", parallel=4, max_trials=4)
    ctls = [SweepController(settings) for _ in range(2)]
    threads = [threading.Thread(target=c.run_pass) for c in ctls for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = trials(db_url, sid)
    assert [t["number"] for t in got] == [0, 1, 2, 3]
    assert len({t["job_id"] for t in got}) == 4
    assert len(study(db_url, sid).trials) == 4


def test_listing_pages_and_owners(factory: Factory, db_url: str) -> None:
    ids = [new_sweep(factory, name=f"s{i}") for i in range(3)]
    other = new_sweep(factory, owner="bob")
    alice = Viewer(factory.user_id("alice"))
    with session_scope(db_url) as s:
        page, cursor = list_sweeps(s, alice, limit=2)
        assert [p["id"] for p in page] == ids[:0:-1] and cursor
        rest, end = list_sweeps(s, alice, cursor=cursor, limit=2)
        assert [p["id"] for p in rest] == ids[:1] and end is None
        assert get_sweep(s, alice, other) is None and sweep_view(s, alice, other) is None
        everyone, _ = list_sweeps(s, Viewer(0, is_admin=True), states=["running"])
        assert len(everyone) == 4


def test_optuna_keeps_its_tables_out_of_torchyards_schema(
    factory: Factory, ctl: SweepController, db_url: str
) -> None:
    sid = new_sweep(factory)
    ctl.run_pass()
    assert migrate.current(db_url) == _head()  # Optuna stamped nothing into our alembic_version
    with session_scope(db_url) as s:
        names = set(inspect(s.connection()).get_table_names())
        assert names - {"alembic_version"} == set(Base.metadata.tables)
        if db_url.startswith("postgresql"):
            q = "SELECT count(*) FROM torchyard_optuna.studies WHERE study_name = :n"
            assert s.scalar(text(q), {"n": sid}) == 1
    assert optuna_url("sqlite:////x/torchyard.db") == "sqlite:////x/torchyard.optuna.db"
    pg = optuna_url("postgresql+psycopg://u:p%40ss@h/db?options=-cstatement_timeout%3D5s")
    assert pg == (
        "postgresql+psycopg://u:p%40ss@h/db"
        "?options=-cstatement_timeout%3D5s+-csearch_path%3Dtorchyard_optuna"
    )


def test_db_upgrade_from_0006_keeps_jobs_beside_optunas_tables(
    empty_url: str, tmp_path: Path
) -> None:
    fresh_url = empty_url
    migrate.upgrade(fresh_url)
    factory = Factory(fresh_url)
    job_id = factory.job()
    sid = new_sweep(factory)
    settings = Settings(_env_file=None, home=tmp_path, database_url=fresh_url)  # type: ignore[call-arg]
    SweepController(settings).run_pass()  # Optuna's tables and its own alembic_version made
    migrate.downgrade(fresh_url, "0006")  # a deployment at 0006, Optuna's tables about
    assert migrate.current(fresh_url) == "0006"
    migrate.upgrade(fresh_url)
    assert migrate.current(fresh_url) == _head()
    with session_scope(fresh_url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.sweep_id is None
    assert len(study(fresh_url, sid).trials) == 1  # Optuna's study untouched by ours


def test_sweep_ids_are_study_names(factory: Factory, ctl: SweepController, db_url: str) -> None:
    sid = new_sweep(factory)
    ctl.run_pass()
    with session_scope(db_url) as s:
        assert s.scalar(select(SweepTrial.sweep_id)) == sid
    assert study(db_url, sid).direction == optuna.study.StudyDirection.MAXIMIZE
