"""Script jobs (`entrypoint`): the user's own training loop, through `torchyard.job`.

A tiny bundle (a deterministic MLP on synthetic tensors, its own `trainer.py` and `client/`
that must neither shadow torchyard nor be shadowed) runs by hand, through
`python -m torchyard.trainer` and through a real torchrun (gloo on CPU); SIGTERM stops it
with a checkpoint and `--resume` continues it to the same weights as an uninterrupted run.
The runner's failure paths and `torchyard.job`'s checks run in this process."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trainer_testlib import (
    REPO,
    load_weights,
    read_events,
    run_trainer,
    trainer_cmd,
    trainer_env,
    wait_for_event,
    write_spec,
)

from torchyard import job
from torchyard.contracts import exitcodes
from torchyard.contracts.eventfiles import rank_events_file
from torchyard.contracts.spec import parse_spec
from torchyard.trainer import checkpoint
from torchyard.trainer import script as script_mod
from torchyard.trainer.distributed import Dist
from torchyard.trainer.events import MemoryEvents
from torchyard.trainer.loop import Run
from torchyard.trainer.script import ScriptBackend, run_script
from torchyard.trainer.signals import StopFlag

# CPU (gloo) everywhere, with the same thread count in every run: bitwise-equal weights.
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
STEPS, SAVE_EVERY = 40, 5
FULL_ARGS = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]

TRAIN_PY = '''\
"""A deterministic little training loop: the batch of step s is a function of s alone."""
import argparse
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import client  # the bundle's own client/ package
import torchyard.contracts.exitcodes  # ours, not the bundle's trainer.py
from torchyard import job
from trainer import build  # the bundle's own trainer.py

assert client.MINE == "user client", client.__file__
assert torchyard.contracts.exitcodes.PREEMPTED == 75

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()


def state(net, opt, step):
    return {"model": net.state_dict(), "opt": opt.state_dict(), "step": step}


def main():
    ctx = job.setup()
    assert job.setup() is ctx
    torch.manual_seed(0)
    net = build().to(ctx.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    x, y = x.to(ctx.device), y.to(ctx.device)
    start = 0
    restored = job.restore()
    if restored is not None:
        net.load_state_dict(restored["model"])
        opt.load_state_dict(restored["opt"])
        start = restored["step"]
        print(f"restored step {start}", flush=True)
    model = DistributedDataParallel(net) if ctx.world_size > 1 else net
    share = 32 // ctx.world_size
    for step in range(start + 1, args.steps + 1):
        batch = torch.randperm(256, generator=torch.Generator().manual_seed(step))[:32]
        mine = batch[ctx.rank * share : (ctx.rank + 1) * share]
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.log(step, **{"train/loss": loss.item()})
        if step % args.save_every == 0:
            job.save(state(net, opt, step), step)
        if job.should_stop():
            job.save(state(net, opt, step), step)
            return
        time.sleep(args.sleep)
    job.save_weights(model.state_dict())


main()
'''
USER_TRAINER_PY = """\
from torch import nn

MINE = "user trainer"


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
"""
BOOM_PY = """\
from torchyard import job

job.setup()
job.log(1, x=1.0)


def inner():
    raise ValueError("boom from the script")


inner()
"""
WEIGHT_KEYS = {"0.weight", "0.bias", "2.weight", "2.bias"}


def write_bundle(d: Path) -> Path:
    (d / "client").mkdir(parents=True)
    (d / "client" / "__init__.py").write_text('MINE = "user client"\n')
    (d / "trainer.py").write_text(USER_TRAINER_PY)
    (d / "train.py").write_text(TRAIN_PY)
    (d / "boom.py").write_text(BOOM_PY)
    return d


def script_spec(script: str = "train.py", args: list[str] | None = None, **over: Any) -> dict:
    spec = {"code": {"bundle": "0" * 64},
            "entrypoint": {"script": script, "args": args if args is not None else FULL_ARGS}}  # fmt: skip
    spec.update(over)
    return spec


def of_type(events: list[dict], t: str) -> list[dict]:
    return [e for e in events if e["type"] == t]


def loss_steps(events: list[dict]) -> list[int]:
    return [e["step"] for e in of_type(events, "metric") if e["name"] == "train/loss"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_equal_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() == WEIGHT_KEYS
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted run at world_size 1 through the trainer (its run dir, the process)."""
    tmp = tmp_path_factory.mktemp("reference")
    bundle = write_bundle(tmp / "bundle")
    spec = write_spec(tmp / "spec.json", script_spec())
    p = run_trainer(spec, tmp / "run", "--code-dir", str(bundle), **ENV)
    return tmp / "run", p


# ---------------------------------------------------------------------------- real processes


def test_by_hand_writes_checkpoints_weights_and_step_lines(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    p = subprocess.run([sys.executable, "train.py", "--steps", "20", "--save-every", "4"],
                       cwd=bundle, env=trainer_env(**ENV), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = [s for s in p.stdout.splitlines() if s.startswith("step ")]
    assert [int(s.split()[1]) for s in lines] == list(range(1, 21))
    assert lines[0].split()[2].startswith("train/loss=")
    run = bundle / "torchyard-run"
    names = sorted(f.name for f in (run / "checkpoints").iterdir())
    assert names == ["step-00000012.pt", "step-00000016.pt", "step-00000020.pt"]  # the last 3
    ckpt = torch.load(run / "checkpoints" / names[-1], weights_only=True)
    assert ckpt["format"] == checkpoint.FORMAT and ckpt["step"] == 20
    assert ckpt["state"]["step"] == 20 and set(ckpt["state"]["model"]) == WEIGHT_KEYS
    assert set(load_weights(run)) == WEIGHT_KEYS


def test_world_size_1_through_the_trainer(reference: tuple[Path, Any]) -> None:
    run_dir, p = reference
    assert p.returncode == 0, p.stderr
    assert "running train.py --steps 40 --save-every 5: 1 rank(s) on cpu" in p.stdout
    events = read_events(run_dir)
    assert events[0]["type"] == "started" and events[-1]["type"] == "finished"
    started = events[0]
    assert started["world_size"] == 1 and started["device"] == "cpu"
    assert started["resumed_from"] is None and started["step"] == 0
    assert "precision" not in started and "total_steps" not in started
    assert loss_steps(events) == list(range(1, STEPS + 1))
    assert of_type(events, "progress") and of_type(events, "progress")[0]["total_steps"] is None
    resumes = [e for e in of_type(events, "checkpoint") if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    pruned = {p for e in resumes for p in e["pruned"]}
    kept = [e for e in resumes if e["path"] not in pruned]
    assert len(kept) == 3 and all(not (run_dir / p).exists() for p in pruned)
    for e in kept:
        assert sha256(run_dir / e["path"]) == e["sha256"]
        assert (run_dir / e["path"]).stat().st_size == e["bytes"]
    assert checkpoint.latest_checkpoint(run_dir) == run_dir / kept[-1]["path"]
    (weights,) = [e for e in of_type(events, "checkpoint") if e["kind"] == "weights"]
    assert weights["path"] == "model.safetensors" and weights["step"] == STEPS
    assert sha256(run_dir / "model.safetensors") == weights["sha256"]
    finished = events[-1]
    assert finished["step"] == STEPS
    assert finished["metrics"] == {"train/loss": of_type(events, "metric")[-1]["value"]}
    assert set(load_weights(run_dir)) == WEIGHT_KEYS


def test_world_size_2_under_torchrun(tmp_path: Path, reference: tuple[Path, Any]) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    spec = write_spec(tmp_path / "spec.json", script_spec(world_size=2))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchyard.trainer", "--spec", str(spec), "--run-dir", str(run_dir),
           "--code-dir", str(bundle)]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=trainer_env(**ENV), capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr[-6000:]
    events = read_events(run_dir)
    assert len(of_type(events, "started")) == 1 and events[0]["world_size"] == 2
    assert events[-1]["type"] == "finished" and events[-1]["step"] == STEPS
    assert loss_steps(events) == list(range(1, STEPS + 1))  # rank 0 alone logs
    rank1 = run_dir / rank_events_file(1)  # rank 1 writes only its errors and stops
    assert rank1.is_file() and rank1.read_text() == ""
    # DDP averages the two half-batches' gradients: the full batch's, up to rounding
    two, one = load_weights(run_dir), load_weights(reference[0])
    assert two.keys() == WEIGHT_KEYS  # no `module.` prefix
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)


def test_sigterm_stops_and_resume_continues_to_the_same_weights(
    tmp_path: Path, reference: tuple[Path, Any]
) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    run_dir = tmp_path / "run"
    slow = write_spec(tmp_path / "slow.json", script_spec(args=[*FULL_ARGS, "--sleep", "0.1"]))
    proc = subprocess.Popen(trainer_cmd(slow, run_dir, "--code-dir", str(bundle)),
                            env=trainer_env(**ENV), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "checkpoint", proc, timeout=60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == exitcodes.PREEMPTED, err
    events = read_events(run_dir)
    (stopped,) = of_type(events, "stopped")
    k = stopped["step"]
    assert stopped["signal"] == "SIGTERM" and SAVE_EVERY <= k < STEPS
    assert stopped["checkpoint"] == f"checkpoints/step-{k:08d}.pt"
    assert not of_type(events, "finished") and loss_steps(events) == list(range(1, k + 1))

    fast = write_spec(tmp_path / "fast.json", script_spec())
    p = run_trainer(fast, run_dir, "--code-dir", str(bundle),
                    "--resume", str(run_dir / stopped["checkpoint"]), **ENV)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"restored step {k}" in p.stdout
    events = read_events(run_dir)
    second = of_type(events, "started")[1]
    assert second["resumed_from"] == stopped["checkpoint"] and second["step"] == k
    assert loss_steps(events) == list(range(1, STEPS + 1))  # both runs: gap-free, no repeats
    assert events[-1]["type"] == "finished" and events[-1]["step"] == STEPS
    assert_equal_weights(load_weights(run_dir), load_weights(reference[0]))


def test_a_script_that_raises_is_a_user_code_error(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle")
    spec = write_spec(tmp_path / "spec.json", script_spec("boom.py", []))
    p = run_trainer(spec, tmp_path / "run", "--code-dir", str(bundle), **ENV)
    assert p.returncode == exitcodes.FAILED
    assert "Traceback (most recent call last)" in p.stderr and "in inner" in p.stderr
    (error,) = of_type(read_events(tmp_path / "run"), "error")
    assert error["kind"] == "user_code" and error["rank"] == 0 and error["step"] == 1
    assert error["message"] == "ValueError: boom from the script"


def test_the_mnist_example_runs_by_hand_on_the_digits_fallback(tmp_path: Path) -> None:
    example = shutil.copytree(REPO / "examples" / "script_mnist", tmp_path / "example")
    env = trainer_env(**ENV, TORCHYARD_DATA_ROOT=str(tmp_path / "no-data"))
    p = subprocess.run([sys.executable, "train.py", "--epochs", "1"], cwd=example, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert sum("digits" in s for s in lines) == 1  # the one line saying so
    losses = [s for s in lines if s.startswith("[1, ")]
    assert losses and all(" loss: " in s for s in losses)
    run = example / "torchyard-run"
    assert (run / "model.safetensors").is_file()
    assert [f.name for f in (run / "checkpoints").iterdir()] == ["step-00000012.pt"]


# ---------------------------------------------------------------------------- in this process


def in_process_run(tmp_path: Path, resume: Path | None = None) -> Run:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return Run(run_dir=run_dir, dist=Dist(rank=0, local_rank=0, world_size=1,
               device=torch.device("cpu")), events=MemoryEvents(), data_root=tmp_path,
               resume=resume, stop=StopFlag(), log=lambda _s: None)  # fmt: skip


def run_here(tmp_path: Path, script: str, body: str | None = None) -> tuple[int, MemoryEvents]:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    if body is not None:
        (bundle / script).write_text(body)
    r = in_process_run(tmp_path)
    code = run_script(parse_spec(script_spec(script, [])), r, bundle)
    assert isinstance(r.events, MemoryEvents)
    return code, r.events


def test_a_missing_script_is_a_user_code_error(tmp_path: Path) -> None:
    code, events = run_here(tmp_path, "nope.py")
    assert code == exitcodes.FAILED
    (error,) = events.of_type("error")
    assert error["kind"] == "user_code" and "no such file" in error["message"]


def test_a_script_outside_the_bundle_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.py").write_text("print('escaped')\n")
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "link.py").symlink_to(tmp_path / "elsewhere.py")
    code, events = run_here(tmp_path, "link.py")
    assert code == exitcodes.FAILED
    (error,) = events.of_type("error")
    assert error["kind"] == "user_code" and "outside the code bundle" in error["message"]


@pytest.mark.parametrize(("body", "code", "kind"), [
    ("import sys\nsys.exit(0)\n", exitcodes.OK, None),
    ("raise SystemExit\n", exitcodes.OK, None),
    ("import sys\nsys.exit(3)\n", exitcodes.FAILED, "user_code"),
    ("raise MemoryError('no room')\n", exitcodes.OUT_OF_MEMORY, "out_of_memory"),
])  # fmt: skip
def test_how_a_script_ends(tmp_path: Path, body: str, code: int, kind: str | None) -> None:
    got, events = run_here(tmp_path, "s.py", body)
    assert got == code
    if kind is None:
        assert events.of_type("finished") and not events.of_type("error")
    else:
        (error,) = events.of_type("error")
        assert error["kind"] == kind and not events.of_type("finished")


def test_a_script_that_never_calls_setup_still_runs(tmp_path: Path) -> None:
    body = "import sys\nprint('hello', sys.argv[1:])\n"
    code, events = run_here(tmp_path, "plain.py", body)
    assert code == exitcodes.OK
    assert [e["type"] for e in events.events] == ["started", "finished"]
    assert events.events[-1]["step"] == 0 and events.events[-1]["metrics"] == {}


def test_argv_and_seed_are_the_specs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    body = "import sys, torch\nprint(sys.argv[1:], torch.randint(0, 10**9, (1,)).item())\n"
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "a.py").write_text(body)
    spec = parse_spec(script_spec("a.py", ["--x", "1"], seed=7))
    assert run_script(spec, in_process_run(tmp_path), tmp_path / "bundle") == exitcodes.OK
    torch.manual_seed(7)
    assert capsys.readouterr().out.strip() == f"['--x', '1'] {torch.randint(0, 10**9, (1,)).item()}"


@pytest.fixture
def backend(tmp_path: Path):
    b = ScriptBackend(parse_spec(script_spec()), in_process_run(tmp_path))
    job._install(b)
    yield b
    job._install(None)


def test_save_refuses_what_weights_only_cannot_load(backend: ScriptBackend) -> None:
    with pytest.raises(TypeError, match=r"state\['extra'\]\['net'\] is a torch\.nn.*Linear"):
        job.save({"step": 1, "extra": {"net": nn.Linear(2, 2)}}, 1)
    with pytest.raises(TypeError, match=r"state\['items'\]\[1\]"):
        job.save({"items": [1, object()]}, 1)
    with pytest.raises(TypeError, match="step"):
        job.save({}, True)  # type: ignore[arg-type]
    run_dir = backend.r.run_dir
    assert not (run_dir / "checkpoints").exists() and not backend.r.events.events
    good = {"t": torch.ones(2), "net": nn.Linear(2, 2).state_dict(),
            "plain": {"a": [1, 2.5, None, "s", (True, -1)]}}  # fmt: skip
    job.save(good, 3)
    (event,) = backend.r.events.events
    assert event["kind"] == "resume" and event["path"] == "checkpoints/step-00000003.pt"
    loaded = torch.load(run_dir / event["path"], weights_only=True)["state"]
    assert loaded["plain"] == {"a": [1, 2.5, None, "s", (True, -1)]}
    assert torch.equal(loaded["t"], good["t"])


def test_restore_reads_back_what_save_wrote(tmp_path: Path, backend: ScriptBackend) -> None:
    assert job.restore() is None
    job.save({"w": torch.arange(4.0), "step": 9}, 9)
    r2 = in_process_run(tmp_path, resume=checkpoint.latest_checkpoint(backend.r.run_dir))
    job._install(ScriptBackend(parse_spec(script_spec()), r2))
    state = job.restore()
    assert state is not None and state["step"] == 9 and torch.equal(state["w"], torch.arange(4.0))


def test_log_checks_names_and_values(backend: ScriptBackend) -> None:
    with pytest.raises(ValueError, match="'Loss'"):
        job.log(1, Loss=1.0)
    with pytest.raises(ValueError, match="'a b'"):
        job.log(1, **{"a b": 1.0})
    with pytest.raises(TypeError, match="'flag'"):
        job.log(1, flag=True)
    with pytest.raises(TypeError, match=r"\.item\(\)"):
        job.log(1, loss=torch.tensor(1.0))  # type: ignore[arg-type]
    job.log(2, **{"val/acc": 1, "train/loss": float("nan")})
    metrics = backend.r.events.of_type("metric")
    assert [(e["name"], e["value"]) for e in metrics] == [("val/acc", 1), ("train/loss", None)]
    job.log(3, **{"train/loss": 0.5})  # within the second: no second progress event
    assert len(backend.r.events.of_type("progress")) == 1


def test_save_weights_drops_wrapper_prefixes_and_unties(backend: ScriptBackend) -> None:
    shared = torch.ones(3, 2)
    job.save_weights({"module._orig_mod.emb.weight": shared, "module.head.weight": shared})
    weights = load_weights(backend.r.run_dir)
    assert set(weights) == {"emb.weight", "head.weight"}
    (event,) = backend.r.events.of_type("checkpoint")
    assert event["kind"] == "weights" and event["sha256"] == sha256(
        backend.r.run_dir / "model.safetensors"
    )


def test_should_stop_follows_the_runners_stop_flag(backend: ScriptBackend) -> None:
    assert job.should_stop() is False and not backend.saw_stop
    backend.r.stop.signal = "SIGTERM"
    assert job.should_stop() is True and backend.saw_stop


def test_checkpoints_of_job_and_trainer_agree() -> None:
    assert job.CHECKPOINT_FORMAT == checkpoint.FORMAT
    assert job.checkpoint_file(Path("checkpoints"), 12).as_posix() == checkpoint.checkpoint_name(12)


def test_by_hand_the_local_backend_keeps_3_restores_the_newest_and_catches_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        local = job._LocalBackend()
        job._install(local)
        ctx = job.setup()
        assert (ctx.rank, ctx.world_size, ctx.is_main) == (0, 1, True)
        assert ctx.run_dir == tmp_path / "torchyard-run" and ctx.run_dir.is_dir()
        assert job.restore() is None
        for step in range(1, 6):
            job.save({"step": step, "w": torch.full((2,), float(step))}, step)
        names = sorted(f.name for f in (ctx.run_dir / "checkpoints").iterdir())
        assert names == [f"step-{s:08d}.pt" for s in (3, 4, 5)]
        state = job.restore()
        assert (
            state is not None
            and state["step"] == 5
            and torch.equal(state["w"], torch.full((2,), 5.0))
        )
        job.log(7, **{"a/b": 1, "loss": 0.25, "bad": float("inf")})
        assert capsys.readouterr().out == "step 7 a/b=1 loss=0.25 bad=inf\n"
        job.save_weights({"module.w": torch.ones(2)})
        assert set(load_weights(ctx.run_dir)) == {"w"}
        assert job.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert job.should_stop() is True
    finally:
        job._install(None)
        signal.signal(signal.SIGTERM, before)


def test_a_one_rank_script_waits_at_its_rungs_and_a_prune_ends_it(tmp_path: Path) -> None:
    """Each job.log holding the objective is an evaluation: at a rung of the plan the script
    waits in log() for the verdict; pruned, it stops there even through `except Exception`
    (the trainer's PRUNED exit, a `stopped` event saying `pruned`, no `finished`)."""
    from torchyard.contracts.rungs import PLAN_FILE, RungPlan, RungVerdict, verdict_file

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = RungPlan(metric="val/accuracy", rungs=[1, 3], offset=1)  # one report before
    (run_dir / PLAN_FILE).write_text(plan.model_dump_json())
    (run_dir / verdict_file(3)).write_text(RungVerdict(index=3, prune=True).model_dump_json())
    body = (
        "from torchyard import job\n"
        "job.setup()\n"
        "for step in range(1, 6):\n"
        "    try:\n"
        "        job.log(step, train_loss=1.0 / step, **{'val/accuracy': step / 10})\n"
        "    except Exception:\n"
        "        pass\n"
        "print('never reached')\n"
    )
    code, events = run_here(tmp_path, "loop.py", body)
    assert code == exitcodes.PRUNED
    rungs = of_type(events.events, "rung")
    assert [(e["index"], e["step"], e["value"]) for e in rungs] == [(3, 2, 0.2)]
    (stopped,) = of_type(events.events, "stopped")
    assert (stopped["signal"], stopped["step"]) == ("pruned", 2)
    assert of_type(events.events, "progress")[-1]["step"] == 2  # where it stopped
    assert not of_type(events.events, "finished")


LOOP = (
    "from torchyard import job\n"
    "job.setup({declare})\n"
    "for step in range(1, 31):\n"
    "    job.log(step, loss=1.0 / step)\n"
)


def test_a_finished_script_shows_its_last_step_of_its_own_length(tmp_path: Path) -> None:
    """No length declared: `step/?` while it runs (one progress a second), then the last
    step as both step and length, not the first second's report."""
    code, events = run_here(tmp_path, "loop.py", LOOP.format(declare=""))
    assert code == exitcodes.OK
    progress = of_type(events.events, "progress")
    assert progress[0]["total_steps"] is None
    assert (progress[-1]["step"], progress[-1]["total_steps"]) == (30, 30)
    assert events.events[-1]["type"] == "finished"


def test_a_declared_length_gives_progress_and_an_eta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(script_mod, "PROGRESS_EVERY_S", 0.0)  # every log reports
    code, events = run_here(tmp_path, "loop.py", LOOP.format(declare="total_steps=30"))
    assert code == exitcodes.OK
    progress = of_type(events.events, "progress")
    assert progress[0] == {**progress[0], "step": 0, "total_steps": 30, "eta_s": None}
    assert [p["total_steps"] for p in progress] == [30] * len(progress)
    mid = next(p for p in progress if p["step"] == 15)
    assert mid["eta_s"] is not None and mid["eta_s"] >= 0
    assert (progress[-1]["step"], progress[-1]["eta_s"]) == (30, 0)


def test_set_total_refuses_what_is_not_a_length(backend: ScriptBackend) -> None:
    for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="total_steps"):
            job.set_total(bad)
    job.set_total(7)
    assert backend.total == 7
