"""The sandboxed slot's zygote (trainer/zygote.py, worker/zygote.py): one warm trainer that
runs job after job, each in a fork, inside one bubblewrap sandbox. Real sandboxes, real
trainers: jobs of one user run back to back without a new import and keep every file of
their run directories; what a hostile job leaves (a daemon that ignores SIGTERM, files in
/tmp and /dev/shm, System V shared memory, a POSIX message queue) is gone before the next job starts; the job
cannot read the zygote's memory; another user's job never gets it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from specs import synthetic_spec

from torchyard.settings import Settings
from torchyard.worker import launch_sandbox
from torchyard.worker.launch_sandbox import SandboxLauncher, SandboxTrainer, exchange
from torchyard.worker.launcher import LaunchRequest
from torchyard.worker.proc import Launch, slot_env, trainer_argv
from torchyard.worker.sandbox import support
from torchyard.worker.standby import WarmTrainer
from torchyard.worker.zygote import ZygoteTrainer

pytestmark = pytest.mark.skipif(
    not support().ok and os.environ.get("CI") != "true", reason=f"no sandbox: {support().why}"
)

LEAVE_BEHIND = """
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:  # a daemon: its own session, deaf to SIGTERM, forever
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open("/job/daemon.pid", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)
while not os.path.exists("/job/daemon.pid"):
    time.sleep(0.01)
open("/tmp/planted", "w").write("x")
open("/dev/shm/planted", "w").write("x")
os.makedirs("/tmp/locked/inner")
os.chmod("/tmp/locked", 0)
shm = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE | IPC_CREAT, owner-only
assert shm >= 0, ctypes.get_errno()
mq = libc.mq_open(b"/planted", os.O_CREAT | os.O_RDWR, 0o600, None)  # a POSIX queue
assert mq >= 0, ctypes.get_errno()
print("LEFT", shm, flush=True)
"""

KILL_THE_ZYGOTE = """
import os, signal
os.kill(os.getppid(), signal.SIGKILL)  # permitted (the same user): it ends its own job
"""

PROBE = """
import json, os
out = {"tmp": sorted(os.listdir("/tmp")), "shm": sorted(os.listdir("/dev/shm"))}
out["sysv"] = open("/proc/sysvipc/shm").read().splitlines()[1:]
import ctypes
mq = ctypes.CDLL(None, use_errno=True).mq_open(b"/planted", os.O_RDONLY, 0, None)
out["mq"] = "opened" if mq >= 0 else os.strerror(ctypes.get_errno())
me, parent = os.getpid(), os.getppid()
out["others"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit()
                       and int(p) not in (1, me, parent))
for what in ("mem", "environ"):
    try:
        with open(f"/proc/{parent}/{what}", "rb") as f:
            f.read(16)
        out[what] = "READ"
    except OSError as e:
        out[what] = type(e).__name__
print("PROBE " + json.dumps(out), flush=True)
"""


def _request(settings: Settings, run: Path, spec: dict[str, Any], code: Path | None = None,
             tenant: int | None = 1, uid: int | None = None) -> LaunchRequest:  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps(spec))
    launch = Launch(spec_path=run / "spec.json", run_dir=run, code_dir=code)
    return LaunchRequest(
        launch=launch,
        argv=trainer_argv(launch),
        env=slot_env(settings, "", {}, attempt=1),
        cwd=run,
        log_path=run / "output.log",
        warm_ok=True,
        runs_code=code is not None,
        tenant=tenant,
        sandbox_uid=uid,
    )


def _bundle(tmp_path: Path, scripts: dict[str, str]) -> Path:
    code = tmp_path / "bundle"
    code.mkdir()
    for name, text in scripts.items():
        (code / name).write_text(text)
    return code


def _script(name: str) -> dict[str, Any]:
    return {"entrypoint": {"script": name}, "code": {"bundle": "0" * 64}}


@pytest.fixture
def slot(tmp_path: Path) -> Any:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    warm = WarmTrainer(lambda: slot_env(settings, "", {}))
    launcher = SandboxLauncher(settings, warm)
    warm.refill()
    yield settings, warm, launcher
    warm.close()


def _run(warm: WarmTrainer, launcher: SandboxLauncher, request: LaunchRequest) -> Any:
    trainer = launcher.start(request)
    rc = trainer.wait(120)
    warm.refill()  # as the worker does once the job has ended
    return trainer, rc


def test_one_users_jobs_run_back_to_back_on_one_zygote(slot: Any) -> None:
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    zygote_pid = warm.proc.pid
    inodes = {}
    for n in ("1", "2", "3"):
        trainer, rc = _run(warm, launcher, _request(settings, runs / n, synthetic_spec()))
        assert isinstance(trainer, ZygoteTrainer), n
        assert rc == 0, (runs / n / "output.log").read_text()
        assert trainer.zygote.proc.pid == zygote_pid  # the same sandbox, no new import
        events = (runs / n / "events.jsonl").read_text()
        assert '"finished"' in events and (runs / n / "model.safetensors").exists()
        inodes[n] = (runs / n / "model.safetensors").stat().st_ino
    # Each run directory kept its files (the same files: links, never copies) after the
    # zygote's /job moved on to the next job; the idle zygote's folder is its only one.
    assert {n: (runs / n / "model.safetensors").stat().st_ino for n in inodes} == inodes
    assert len(list(runs.glob(".next-*"))) == 1
    assert warm.ready() or warm.proc.poll() is None


@pytest.mark.hostile
def test_what_a_job_leaves_is_gone_before_the_next_one(slot: Any, tmp_path: Path) -> None:
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    code = _bundle(tmp_path, {"leave.py": LEAVE_BEHIND, "probe.py": PROBE})
    zygote_pid = warm.proc.pid
    _, rc = _run(warm, launcher, _request(settings, runs / "a", _script("leave.py"), code))
    log = (runs / "a" / "output.log").read_text()
    assert rc == 0 and "LEFT" in log, log
    daemon_inside = int((runs / "a" / "daemon.pid").read_text())
    assert daemon_inside > 1
    assert warm.proc is not None and warm.proc.pid == zygote_pid  # taken back, clean
    second, rc = _run(warm, launcher, _request(settings, runs / "b", _script("probe.py"), code))
    log = (runs / "b" / "output.log").read_text()
    assert rc == 0 and isinstance(second, ZygoteTrainer), log
    assert second.zygote.proc.pid == zygote_pid
    out = json.loads(next(x for x in log.splitlines() if x.startswith("PROBE "))[6:])
    assert out["others"] == []  # the daemon is dead: nothing but init, zygote and itself
    # (Only what leads to the data root, which lies under /tmp here, is left of /tmp.)
    assert not {"planted", "locked"} & set(out["tmp"]), out
    assert out["shm"] == [] and out["sysv"] == []
    assert out["mq"] == os.strerror(2)  # ENOENT: the last job's POSIX queue is gone
    # The zygote is not dumpable: the job's code (the same user) cannot read its memory.
    assert out["mem"] == "PermissionError" and out["environ"] == "PermissionError"


def test_another_users_job_never_gets_the_zygote(slot: Any) -> None:
    """A zygote runs as one host uid: the slot's first as no user's (TORCHYARD_SANDBOX_UID),
    each later one as the uid of the user the slot last served; another user's job starts
    cold, as its own uid, and the next zygote is that user's."""
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    base, user2 = settings.sandbox_uid, settings.sandbox_uid + 2
    first, rc = _run(warm, launcher, _request(settings, runs / "1", synthetic_spec(), None))
    assert isinstance(first, ZygoteTrainer) and rc == 0
    served = first.zygote
    other = launcher.start(_request(settings, runs / "2", synthetic_spec(), tenant=2, uid=user2))
    assert isinstance(other, SandboxTrainer)  # cold, in a sandbox of its own
    assert served.proc.poll() is not None  # the zygote of no user is gone
    assert other.wait(120) == 0, (runs / "2" / "output.log").read_text()
    warm.refill()  # a fresh zygote, user 2's
    third = launcher.start(_request(settings, runs / "3", synthetic_spec(), tenant=2, uid=user2))
    assert isinstance(third, ZygoteTrainer) and third.zygote is not served
    assert third.wait(120) == 0
    if os.geteuid() == 0:  # a root worker: each job's files are its user's uid's
        owners = [(runs / n / "model.safetensors").stat().st_uid for n in "123"]
        assert owners == [base, user2, user2] and third.zygote.uid == user2


def test_sigterm_reaches_the_forked_trainer_and_kill_ends_the_sandbox(slot: Any) -> None:
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    request = _request(settings, runs / "1", synthetic_spec(epochs=10_000))
    trainer = launcher.start(request)
    assert isinstance(trainer, ZygoteTrainer)
    deadline = time.monotonic() + 60
    while '"started"' not in _read(runs / "1" / "events.jsonl"):
        assert time.monotonic() < deadline, _read(runs / "1" / "output.log")
        time.sleep(0.05)
    trainer.terminate()
    assert trainer.wait(60) is not None
    assert '"stopped"' in _read(runs / "1" / "events.jsonl")
    warm.refill()
    again = launcher.start(dataclasses.replace(request, log_path=runs / "1" / "again.log"))
    assert isinstance(again, ZygoteTrainer) and again.zygote is trainer.zygote
    deadline = time.monotonic() + 60
    while _read(runs / "1" / "events.jsonl").count('"started"') < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again.kill()  # the whole sandbox: the job and the zygote
    assert again.wait(10) == -9
    assert trainer.zygote.proc.poll() is not None
    warm.refill()
    assert warm.proc is not None and warm.proc is not trainer.zygote.proc  # a new one


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.hostile
def test_a_job_that_kills_its_zygote_only_ends_itself(slot: Any, tmp_path: Path) -> None:
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    code = _bundle(tmp_path, {"kill.py": KILL_THE_ZYGOTE})
    trainer, rc = _run(warm, launcher, _request(settings, runs / "a", _script("kill.py"), code))
    assert isinstance(trainer, ZygoteTrainer) and rc == -9  # the namespace went, and it too
    assert trainer.zygote.proc.poll() is not None
    assert warm.proc is not None and warm.proc is not trainer.zygote.proc  # a fresh one
    nxt, rc = _run(warm, launcher, _request(settings, runs / "b", synthetic_spec()))
    assert isinstance(nxt, ZygoteTrainer) and rc == 0, (runs / "b" / "output.log").read_text()


def _take_over(run: Path, theirs: Path) -> None:
    """What another worker's hand-over does to a run directory once the job was given to
    it: its zygote's folder takes the name (one exchange), and it removes what the old
    name held (this worker's zygote's folder: its files live on as links)."""
    theirs.mkdir()
    (theirs / "theirs.txt").write_text("attempt 2")
    exchange(run, theirs)
    shutil.rmtree(theirs)


def test_a_run_directory_another_attempt_took_over_is_left_alone(slot: Any) -> None:
    """A worker frozen or cut off past its lease finds, once back, that its job's run
    directory is another attempt's: it must not take its zygote's folder back through that
    name (that swapped the live attempt's files out, and the job lost its final weights)."""
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    trainer = launcher.start(_request(settings, runs / "1", synthetic_spec()))
    assert isinstance(trainer, ZygoteTrainer) and trainer.wait(120) == 0
    _take_over(runs / "1", runs / "other")
    taken = (runs / "1").stat().st_ino
    warm.refill()
    assert (runs / "1" / "theirs.txt").read_text() == "attempt 2"
    assert (runs / "1").stat().st_ino == taken  # the name still holds their folder
    assert trainer.zygote.proc.poll() is not None  # not taken back: a new one instead
    assert warm.proc is not None and warm.proc is not trainer.zygote.proc
    nxt = launcher.start(_request(settings, runs / "2", synthetic_spec()))
    assert isinstance(nxt, ZygoteTrainer) and nxt.wait(120) == 0
    assert (runs / "2" / "model.safetensors").exists()


def test_a_take_over_racing_the_swap_back_is_undone(
    slot: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other attempt's hand-over lands between the check and the swap: the swap's
    result is checked too, and its folder goes back under the run directory's name."""
    settings, warm, launcher = slot
    runs = settings.storage / "jobs"
    trainer = launcher.start(_request(settings, runs / "1", synthetic_spec()))
    assert isinstance(trainer, ZygoteTrainer) and trainer.wait(120) == 0
    real_mirror = launch_sandbox.mirror

    def mirror_then_taken(src: Path, dst: Path) -> None:
        real_mirror(src, dst)
        if src == runs / "1":
            _take_over(runs / "1", runs / "other")

    monkeypatch.setattr(launch_sandbox, "mirror", mirror_then_taken)
    warm.refill()
    assert (runs / "1" / "theirs.txt").read_text() == "attempt 2"
    assert not (runs / "1" / "model.safetensors").exists()  # theirs only, no stale links
    assert trainer.zygote.proc.poll() is not None
    assert not [p for p in runs.glob(".next-*") if (p / "model.safetensors").exists()]
