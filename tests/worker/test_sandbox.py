"""The trainer's sandbox (worker/sandbox.py, worker/launch_sandbox.py) and the capped log
pipe (worker/logpump.py): what a job's code can and cannot reach, a real trainer run cold
and warm inside it, SIGTERM reaching the trainer through bwrap, and a log that stops
growing at its cap while the job goes on. The attacks are `hostile`; the whole-pool ones
(a script job against a running worker) are in tests/worker/test_hostile_sandbox.py."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from specs import synthetic_spec

from torchyard.settings import Settings
from torchyard.worker.launch_local import LocalLauncher
from torchyard.worker.launch_sandbox import (
    SandboxLauncher,
    SandboxTrainer,
    inputs_in_run_dir,
    mirror,
    sweep_next_folders,
)
from torchyard.worker.launcher import LaunchRequest, SandboxRefused, choose_launcher
from torchyard.worker.logpump import LogPump, cut_marker
from torchyard.worker.proc import Launch, slot_env, trainer_argv
from torchyard.worker.sandbox import (
    Mounts,
    Support,
    identity,
    sandbox_argv,
    sandbox_env,
    support,
)
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.zygote import ZygoteTrainer

needs_bwrap = pytest.mark.skipif(
    not support().ok and os.environ.get("CI") != "true", reason=f"no sandbox: {support().why}"
)

PROBE = r"""
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        open(p).read()
        out[p] = "read"
    except OSError as e:
        out[p] = type(e).__name__
out["uid"] = os.getuid()
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["env"] = sorted(os.environ)
open("/job/mine.txt", "w").write("ok")
print(json.dumps(out))
"""


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / "runs" / "other").mkdir(parents=True)
    (h / "admin-token").write_text("ty_admin_secret")
    (h / "torchyard.db").write_text("db")
    (h / "runs" / "other" / "ckpt.pt").write_text("someone else's weights")
    return h


@needs_bwrap
@pytest.mark.hostile
def test_a_sandboxed_process_sees_only_its_own_files(home: Path, tmp_path: Path) -> None:
    run = home / "runs" / "mine"
    run.mkdir()
    code = tmp_path / "code"
    code.mkdir()
    ident = identity(64000)
    owner = ident.owns()
    if owner:
        os.chown(run, *owner)
    secrets = [
        str(home / "admin-token"),
        str(home / "torchyard.db"),
        str(home / "runs" / "other" / "ckpt.pt"),
        f"/proc/{os.getpid()}/environ",
        "/etc/shadow",
    ]
    argv = sandbox_argv([sys.executable, "-c", PROBE, *secrets], Mounts(run, code=code), ident)
    worker_env = {**os.environ, "TORCHYARD_HOME": str(home), "TORCHYARD_ADMIN_TOKEN": "x"}
    env = sandbox_env(worker_env, os.path.dirname(sys.executable))
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for p in secrets:
        assert out[p] in ("FileNotFoundError", "PermissionError"), (p, out[p])
    assert (out["uid"] != 0 and out["uid"] != os.getuid()) or not ident.drop
    assert os.getpid() not in out["pids"] and max(out["pids"]) < 10  # its own PID namespace
    assert not [k for k in out["env"] if k.startswith("TORCHYARD_HOME") or "ADMIN" in k]
    assert (run / "mine.txt").read_text() == "ok"


def test_the_environment_is_an_allow_list() -> None:
    worker = {
        "TORCHYARD_HOME": "/h",
        "TORCHYARD_DATABASE_URL": "postgresql://u:pw@db/t",
        "AWS_SECRET_ACCESS_KEY": "k",
        "NCCL_DEBUG": "INFO",
        "TORCHYARD_ATTEMPT": "2",
        "TORCHYARD_LEASE_FILE": "/h/leases/1/trainer.lease",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    env = sandbox_env(worker, "/venv/bin")
    assert env["NCCL_DEBUG"] == "INFO" and env["TORCHYARD_ATTEMPT"] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["TORCHYARD_LEASE_FILE"] == "/run/torchyard/lease"  # where it sees its lease
    for gone in ("TORCHYARD_HOME", "TORCHYARD_DATABASE_URL", "AWS_SECRET_ACCESS_KEY"):
        assert gone not in env
    assert env["HOME"] == "/tmp" and env["PATH"].startswith("/venv/bin:")


def test_no_worker_setting_reaches_an_unsandboxed_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHYARD_ADMIN_TOKEN", "ty_x")
    monkeypatch.setenv("TORCHYARD_HOME", "/somewhere")
    env = slot_env(Settings(), "", {})
    assert "TORCHYARD_ADMIN_TOKEN" not in env and "TORCHYARD_HOME" not in env
    assert env["TORCHYARD_DIE_WITH_PARENT"] == "1"


def test_the_launcher_follows_the_setting(tmp_path: Path) -> None:
    off = choose_launcher(Settings(home=tmp_path, sandbox="off"))
    assert isinstance(off, LocalLauncher)
    on = choose_launcher(Settings(home=tmp_path))
    assert isinstance(on, SandboxLauncher)


def _request(settings: Settings, run: Path, **kw: object) -> LaunchRequest:
    run.mkdir(parents=True, exist_ok=True)
    spec = run / "spec.json"
    spec.write_text(json.dumps(synthetic_spec()))
    launch = Launch(spec_path=spec, run_dir=run)
    env = slot_env(settings, "", {}, attempt=1)
    options: dict[str, object] = {"warm_ok": True, **kw}
    return LaunchRequest(
        launch=launch,
        argv=trainer_argv(launch),
        env=env,
        cwd=run,
        log_path=run / "output.log",
        **options,  # type: ignore[arg-type]
    )


def test_user_code_is_refused_where_the_host_cannot_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    launcher = SandboxLauncher(settings, None)
    monkeypatch.setattr(
        "torchyard.worker.launch_sandbox.support", lambda: Support(False, "no bwrap here")
    )
    with pytest.raises(SandboxRefused, match="no bwrap here"):
        launcher.start(_request(settings, tmp_path / "run", runs_code=True))
    # Built-in code still runs (unsandboxed), so a host without namespaces is still useful.
    trainer = launcher.start(_request(settings, tmp_path / "run2"))
    assert trainer.wait(120) == 0


@needs_bwrap
def test_a_real_trainer_runs_cold_and_warm_inside(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    warm = WarmTrainer(lambda: slot_env(settings, "", {}))
    launcher = SandboxLauncher(settings, warm)
    runs = settings.storage / "jobs"
    cold = launcher.start(_request(settings, runs / "1", warm_ok=False))
    assert isinstance(cold, SandboxTrainer)
    assert cold.wait(120) == 0, (runs / "1" / "output.log").read_text()
    events = (runs / "1" / "events.jsonl").read_text()
    assert '"finished"' in events and (runs / "1" / "model.safetensors").exists()
    warm.refill()
    assert warm.proc is not None
    standby_pid = warm.proc.pid
    handed = launcher.start(_request(settings, runs / "2"))
    assert isinstance(handed, ZygoteTrainer) and handed.zygote.proc.pid == standby_pid  # warm
    assert handed.wait(120) == 0, (runs / "2" / "output.log").read_text()
    assert '"finished"' in (runs / "2" / "events.jsonl").read_text()
    assert (runs / "2" / "spec.json").exists()  # the worker's files moved in with it
    assert not list(runs.glob(".next-*"))  # the standby's folder became the run dir
    warm.close()


@needs_bwrap
def test_a_resume_from_the_runs_own_checkpoint_is_handed_to_the_warm_trainer(
    tmp_path: Path,
) -> None:
    # A paused sweep trial or a preempted job resumes from a checkpoint in its run dir:
    # the warm standby takes it (no cold start), and every file of the run is there.
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    warm = WarmTrainer(lambda: slot_env(settings, "", {}))
    launcher = SandboxLauncher(settings, warm)
    run = settings.storage / "jobs" / "1"
    request = _request(settings, run, warm_ok=False)
    spec = synthetic_spec(epochs=2, batch_size=16,
                          checkpoint={"every_steps": 2, "every_epochs": None, "keep_last": 4})  # fmt: skip
    request.launch.spec_path.write_text(json.dumps(spec))
    assert launcher.start(request).wait(120) == 0, _read(run / "output.log")
    first = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    ckpts = sorted(e["path"] for e in first if e["type"] == "checkpoint")
    assert len(ckpts) >= 2
    (run / "kept").mkdir()
    (run / "kept" / "notes.txt").write_text("the worker's")  # a file no trainer rewrites
    before = {rel: (run / rel).stat().st_ino for rel in (ckpts[0], "kept/notes.txt")}
    warm.refill()
    assert warm.proc is not None
    standby_pid = warm.proc.pid
    resumed = dataclasses.replace(request.launch, resume=run / ckpts[0])
    again = dataclasses.replace(request, launch=resumed, warm_ok=True)
    handed = launcher.start(again)
    assert isinstance(handed, ZygoteTrainer) and handed.zygote.proc.pid == standby_pid  # warm
    assert handed.wait(120) == 0, _read(run / "output.log")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["type"] == "started"]
    assert started[-1]["resumed_from"] == ckpts[0] and started[-1]["step"] == 2
    assert events[-1]["type"] == "finished" and events[-1]["step"] == 8
    # The earlier attempt's files are the same files (links, never copies), none lost.
    assert {rel: (run / rel).stat().st_ino for rel in before} == before
    assert (run / "spec.json").exists() and not list(run.parent.glob(".next-*"))
    warm.close()


def test_init_weights_from_elsewhere_start_cold(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "1"
    run.mkdir(parents=True)
    own = Launch(spec_path=run / "spec.json", run_dir=run, resume=run / "checkpoints" / "a.pt")
    assert inputs_in_run_dir(own)
    other = dataclasses.replace(own, init=tmp_path / "runs" / "2" / "model.safetensors")
    assert not inputs_in_run_dir(other)
    escape = dataclasses.replace(own, resume=run / ".." / "2" / "checkpoints" / "a.pt")
    assert not inputs_in_run_dir(escape)


def test_a_hand_over_links_the_run_dir_and_a_crash_midway_loses_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-2.pt").write_bytes(b"weights")
    (run / "events.jsonl").write_text("{}\n")
    os.symlink("/etc/passwd", run / "link")  # a job's own symlink stays one, never followed
    nxt = tmp_path / "next"
    nxt.mkdir()
    mirror(run, nxt)
    assert (nxt / "checkpoints" / "step-2.pt").stat().st_ino == (
        run / "checkpoints" / "step-2.pt"
    ).stat().st_ino
    assert os.readlink(nxt / "link") == "/etc/passwd"
    # Killed before the swap: the run dir is untouched; the links are the only leftover.
    assert (run / "checkpoints" / "step-2.pt").read_bytes() == b"weights"
    # A run dir filled with files is not linked one by one: that job starts cold.
    many = tmp_path / "many"
    many.mkdir()
    for i in range(5):
        (many / str(i)).touch()
    (tmp_path / "dst").mkdir()
    with pytest.raises(OSError, match="over 4 files"):
        mirror(many, tmp_path / "dst", limit=4)


def test_standby_folders_of_dead_workers_are_swept(tmp_path: Path) -> None:
    host = socket.gethostname()
    gone = tmp_path / f".next-{host}-999999999-abc"  # above pid_max: no such process
    live = tmp_path / f".next-{host}-{os.getpid()}-abc"
    other_host = tmp_path / ".next-elsewhere-999999999-abc"
    for d in (gone, live, other_host):
        (d / "checkpoints").mkdir(parents=True)
    sweep_next_folders(tmp_path)
    assert not gone.exists() and live.exists() and other_host.exists()


@needs_bwrap
def test_sigterm_reaches_the_trainer_inside(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    launcher = SandboxLauncher(settings, None)
    run = settings.storage / "jobs" / "1"
    request = _request(settings, run, warm_ok=False)
    spec = synthetic_spec(epochs=10_000)
    request.launch.spec_path.write_text(json.dumps(spec))
    trainer = launcher.start(request)
    deadline = time.monotonic() + 60
    while '"started"' not in _read(run / "events.jsonl") and time.monotonic() < deadline:
        time.sleep(0.1)
    trainer.terminate()
    rc = trainer.wait(60)
    events = _read(run / "events.jsonl")
    assert '"stopped"' in events or '"checkpoint"' in events, (rc, events[-500:])


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.hostile
def test_a_flood_of_output_is_cut_at_the_cap_and_the_job_goes_on(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    r, w = os.pipe()
    pump = LogPump(r, 100_000, log)
    flood = "import sys\nfor _ in range(3000): sys.stdout.write('x' * 1000 + '\\n')\nprint('end')"
    proc = subprocess.Popen([sys.executable, "-c", flood], stdout=w)
    os.close(w)
    assert proc.wait(60) == 0  # never blocked on a full pipe
    pump.join(10)
    data = log.read_bytes()
    assert len(data) <= 100_000 + len(cut_marker(100_000))
    assert data.endswith(cut_marker(100_000))


@pytest.mark.hostile
def test_the_log_is_never_opened_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "worker-file"
    victim.write_text("precious")
    (tmp_path / "output.log").symlink_to(victim)
    r, w = os.pipe()
    with pytest.raises(OSError):
        LogPump(r, 1000, tmp_path / "output.log")
    os.close(r)
    os.close(w)
    assert victim.read_text() == "precious"
