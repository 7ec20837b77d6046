"""`torchyard sweep create|status|list|cancel` and the SDK's sweep methods against the real
API (a TestClient of create_app on SQLite), with the real sweep controller run in the
background and its trial jobs driven through the store as a worker would."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import test_client_bundle_submit
import test_client_cli
from client_server import Store
from fastapi.testclient import TestClient
from sqlalchemy import select

from torchyard.client import render
from torchyard.client.bundle import bundle_id, pack
from torchyard.client.cli import describe_sweep
from torchyard.client.errors import InvalidSpec, NotFound
from torchyard.client.sdk import Client
from torchyard.scheduler.sweeps import SweepController
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Job, Sweep

Run = test_client_cli.Run
run = test_client_cli.run  # the fixture: run(*argv) -> (exit code, stdout, stderr)
coder = test_client_bundle_submit.coder  # a token that may run code
code_dir = test_client_bundle_submit.code_dir  # train.py, and data.bin that it ignores

SWEEP_YAML = """\
name: lr-search
spec:
  model: {name: mlp, hidden: [16]}
  data: {name: synthetic, shape: [1, 8, 8], num_classes: 4, size: 64}
  optimizer: {name: sgd, lr: 0.1}
  epochs: 1
space:
  optimizer.lr: {type: float, low: 0.01, high: 0.3, log: true}
  model.hidden: {type: categorical, choices: [[16], [32, 16]]}
objective: {metric: val/loss, mode: min}
trials: 3
parallel: 2
sampler: random
seed: 5
"""


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(SWEEP_YAML)
    return p


@pytest.fixture
def scheduler(store: Store, settings: Settings) -> Iterator[Callable[[], None]]:
    """start(): the sweep controller's passes in the background, each queued trial job run
    to success by hand (metrics included, as client_server.Store.run writes them)."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def loop() -> None:
        ctl = SweepController(settings)
        while not stop.is_set():
            ctl.run_pass()
            with session_scope(store.url) as s:
                queued = s.scalars(
                    select(Job.id).where(Job.sweep_id.is_not(None), Job.state == "queued")
                ).all()
            for job_id in queued:
                store.run(job_id, "succeeded")
            time.sleep(0.02)

    def start() -> None:
        threads.append(threading.Thread(target=loop, daemon=True))
        threads[-1].start()

    yield start
    stop.set()
    for t in threads:
        t.join(30)


def test_create_follow_shows_the_trials_until_the_sweep_ends(
    run: Run, sweep_file: Path, scheduler: Callable[[], None]
) -> None:
    scheduler()
    rc, out, err = run("sweep", "create", str(sweep_file), "--follow", "--interval", "0.05")
    assert rc == 0, err
    (sweep_id,) = out.split()
    assert f"sweep {sweep_id} succeeded — 3/3 done (3 complete)" in err
    assert "best val/loss 0.5000: trial 0, job " in err  # a tie: the first trial wins
    table = err[err.rindex("#  JOB") :].splitlines()
    assert [row.split()[0] for row in table[1:4]] == ["0", "1", "2"]
    assert all(" complete " in row for row in table[1:4])
    assert "optimizer.lr" in table[0] and "model.hidden" in table[0]
    assert "\x1b[" not in err  # not a terminal: plain text


def test_status_list_and_cancel(run: Run, sweep_file: Path, http: TestClient, token: str) -> None:
    _, out, _ = run("sweep", "create", str(sweep_file))
    sweep_id = out.strip()
    rc, out, _ = run("sweep", "status", sweep_id[:7])
    assert rc == 0 and sweep_id in out and "running" in out and "0/3 done" in out
    rc, out, _ = run("sweep", "status", sweep_id, "--json")
    body = http.get(f"/v1/sweeps/{sweep_id}", headers={"Authorization": f"Bearer {token}"})
    assert out == json.dumps(body.json(), indent=2) + "\n"
    rc, out, _ = run("sweep", "list")
    assert out.splitlines()[0].split() == ["ID", "NAME", "STATE", "TRIALS", "BEST", "CREATED"]
    assert out.splitlines()[1].split()[:3] == [sweep_id[:12], "lr-search", "running"]
    rc, out, _ = run("sweep", "cancel", sweep_id[:8])
    assert (rc, out) == (0, f"sweep {sweep_id} cancelled\n")
    rc, out, _ = run("sweep", "cancel", sweep_id)
    assert (rc, out) == (0, f"sweep {sweep_id} already cancelled: nothing to cancel\n")
    rc, out, _ = run("sweep", "list", "--state", "running")
    assert out == "no sweeps in state running\n"
    rc, _, err = run("sweep", "status", sweep_id, "--follow", "--interval", "0")
    assert rc == 1 and f"sweep {sweep_id} cancelled" in err


def test_a_rejected_sweep_is_one_line_and_exit_2(run: Run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SWEEP_YAML.replace("low: 0.01", "low: -1"))
    rc, out, err = run("sweep", "create", str(bad))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: 422 ") and "space.optimizer.lr.low" in err
    rc, _, err = run("sweep", "status", "f" * 32)
    assert rc == 1 and err.startswith("error: 404 ")
    rc, _, err = run("sweep", "status", "zz")
    assert rc == 1 and "not a sweep id" in err
    rc, _, err = run("sweep")
    assert rc == 2 and "action" in err


def test_the_sdk_names_every_problem(ty: Client, sweep_file: Path) -> None:
    from torchyard.client.sdk import load_spec

    body = load_spec(sweep_file)
    created = ty.create_sweep(body)
    assert ty.get_sweep(created["id"])["name"] == "lr-search"
    assert [s["id"] for s in ty.list_sweeps()["items"]] == [created["id"]]
    assert ty.cancel_sweep(created["id"])["state"] == "cancelled"
    body["trials"] = 0
    with pytest.raises(InvalidSpec) as e:
        ty.create_sweep(body)
    assert ("trials", "Input should be greater than or equal to 1") in e.value.problems


def test_trials_are_shown_best_first_for_either_mode() -> None:
    trials = [
        {"number": n, "job_id": f"j{n}", "params": {"x": n}, "state": "succeeded",
         "status": "complete", "value": v, "step": 4, "pruned": False}
        for n, v in ((0, 0.5), (1, 0.9), (2, None), (3, 0.7))
    ]  # fmt: skip
    for mode, order in (("max", ["1", "3", "0", "2"]), ("min", ["0", "3", "1", "2"])):
        sweep = {"id": "s", "objective": {"metric": "m", "mode": mode}, "trials": trials,
                 "counts": {"complete": 3}, "max_trials": 4}  # fmt: skip
        text = render.to_text(describe_sweep(sweep))
        rows = text[text.index("#  JOB") :].splitlines()[1:]
        assert [r.split()[0] for r in rows] == order


def test_a_paused_trial_shows_its_rung_and_is_not_done() -> None:
    trials = [
        {"number": 0, "job_id": "j0", "params": {"x": 0}, "state": "queued", "status": "paused",
         "paused_at": 3, "value": 0.8, "step": 30, "pruned": False},
        {"number": 1, "job_id": "j1", "params": {"x": 1}, "state": "cancelled",
         "status": "pruned", "paused_at": None, "value": 0.2, "step": 10, "pruned": True},
    ]  # fmt: skip
    sweep = {"id": "s", "objective": {"metric": "m", "mode": "max"}, "trials": trials,
             "counts": {"paused": 1, "pruned": 1}, "max_trials": 4}  # fmt: skip
    text = render.to_text(describe_sweep(sweep))
    assert "1/4 done (1 paused, 1 pruned)" in text
    assert "paused at eval 3" in text


def test_follow_on_a_terminal_redraws_in_place(
    ty: Client, sweep_file: Path, scheduler: Callable[[], None]
) -> None:
    from torchyard.client.cli import follow_sweep
    from torchyard.client.sdk import load_spec

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    sweep_id = ty.create_sweep(load_spec(sweep_file))["id"]
    scheduler()
    stream = Tty()
    assert follow_sweep(ty, sweep_id, interval_s=0.05, stream=stream) == 0
    assert "\x1b[" in stream.getvalue() and "succeeded" in stream.getvalue()


# -- sweep create --code: a script sweep with its bundle --------------------------------------

SCRIPT_SWEEP_YAML = """\
name: script-search
spec:
  entrypoint: {script: train.py}
space:
  entrypoint.args: {type: categorical, choices: [['--lr', '0.1'], ['--lr', '0.01']]}
objective: {metric: val/score, mode: max}
trials: 2
parallel: 2
sampler: grid
"""


def _script_sweep(tmp_path: Path, text: str = SCRIPT_SWEEP_YAML) -> Path:
    p = tmp_path / "script_sweep.yaml"
    p.write_text(text)
    return p


def _stored(store: Store, sweep_id: str) -> tuple[dict, list[dict]]:
    """The sweep's stored base spec and the specs of its trial jobs so far."""
    with session_scope(store.url) as s:
        spec = s.scalar(select(Sweep.spec).where(Sweep.id == sweep_id))
        trials = s.scalars(select(Job.spec).where(Job.sweep_id == sweep_id)).all()
    assert spec is not None
    return spec, list(trials)


def test_create_with_code_runs_the_bundle_in_every_trial(
    run: Run, tmp_path: Path, code_dir: Path, coder: str, store: Store, settings: Settings,
    http: TestClient,
) -> None:  # fmt: skip
    rc, out, err = run("sweep", "create", str(_script_sweep(tmp_path)), "--code", str(code_dir),
                       token=coder)  # fmt: skip
    assert rc == 0, err
    (sweep_id,) = out.split()
    bid = bundle_id(pack(code_dir))
    assert "code: " in err and "uploaded" in err  # said as submit says it
    spec, _ = _stored(store, sweep_id)
    assert spec == {"entrypoint": {"script": "train.py"}, "code": {"bundle": bid}}
    # The bundle is the user's on the server: train.py and .torchyardignore, not data.bin.
    assert Client(token=coder, http=http).bundle(bid)["files"] == 2
    SweepController(settings).run_pass()  # queues the trials
    _, trials = _stored(store, sweep_id)
    assert len(trials) == 2 and all(t["code"] == {"bundle": bid} for t in trials)


def test_create_with_code_over_a_named_bundle_and_a_space_of_bundles(
    run: Run, tmp_path: Path, code_dir: Path, coder: str, store: Store, http: TestClient
) -> None:
    ty = Client(token=coder, http=http)
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.py").write_text("print('an older script')\n")
    old = ty.push_code(other)
    named = SCRIPT_SWEEP_YAML.replace("spec:\n", f"spec:\n  code: {{bundle: {old}}}\n")
    # The flag wins over the file's bundle, as `submit --code` wins over the spec's.
    rc, out, err = run("sweep", "create", str(_script_sweep(tmp_path, named)),
                       "--code", str(code_dir), token=coder)  # fmt: skip
    assert rc == 0, err
    spec, _ = _stored(store, out.strip())
    assert spec["code"] == {"bundle": bundle_id(pack(code_dir))}
    # A space that varies the bundle cannot run one bundle in every trial: refused, and
    # nothing is uploaded.
    (code_dir / "train.py").write_text("print('changed')\n")
    varied = SCRIPT_SWEEP_YAML.replace(
        "space:\n", f"space:\n  code.bundle: {{type: categorical, choices: [{old}]}}\n"
    )
    rc, out, err = run("sweep", "create", str(_script_sweep(tmp_path, varied)),
                       "--code", str(code_dir), token=coder)  # fmt: skip
    assert (rc, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("error: 422 ") and "space.code.bundle" in err and "--code" in err
    with pytest.raises(NotFound):
        ty.bundle(bundle_id(pack(code_dir)))
