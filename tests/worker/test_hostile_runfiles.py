"""Issue 42's criticals: the worker, as root, never acts on a path in a run directory that
the job can rename or replace (each test failed on the code before storage/beneath.py).

1. init weights: a job swaps its checkpoint for a link after the worker checked it; the
   trainer of another job must get the checked bytes, never the link's target.
2. the job log: a job makes `output.log` a link; the worker's markers never reach the
   target, and a job-chosen string in a marker cannot form shell syntax.
3. the spec: a job plants a link at the spec's temporary name; nothing is truncated.
Then what the worker records of a checkpoint is what it measured, and a root worker's run
directory lets the job replace none of the worker's own files."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from torchyard.contracts.eventmodel import CheckpointEvent
from torchyard.settings import Settings
from torchyard.storage import beneath
from torchyard.store.models import Checkpoint
from torchyard.worker.events import EventRecorder
from torchyard.worker.inputs import InputError, init_file
from torchyard.worker.launch_sandbox import SandboxLauncher
from torchyard.worker.runfiles import append_to_log, quoted, write_spec_file
from torchyard.worker.runlimits import run_dir_over
from torchyard.worker.sandbox import give_run_dir

pytestmark = pytest.mark.hostile
ROOT = os.geteuid() == 0
JOB = "a" * 32


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "admin-token"
    p.write_text("tok_admin_secret")
    p.chmod(0o600)
    return p


@pytest.mark.skipif(not ROOT, reason="the copy for the sandbox's user is a root worker's")
def test_init_weights_swapped_for_a_link_after_the_check_give_the_checked_bytes(
    tmp_path: Path, secret: Path
) -> None:
    settings = Settings(home=tmp_path / "home", storage_root=tmp_path / "storage")
    run = tmp_path / "storage" / "jobs" / JOB
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "last.pt"
    ckpt.write_bytes(b"the real weights")
    row = Checkpoint(job_id=JOB, path="checkpoints/last.pt",
                     sha256=hashlib.sha256(b"the real weights").hexdigest())  # fmt: skip
    checked = init_file(settings, row)  # the worker checks the recorded sha256 ...
    ckpt.unlink()  # ... and the job (inotify on its folder) swaps in a link at once
    ckpt.symlink_to(secret)
    launcher = SandboxLauncher(settings, None)
    inputs: list[tuple[Path, Path]] = []
    inside = launcher._input(checked, tmp_path / "storage" / "jobs" / ("b" * 32), "init", inputs)
    assert inside is not None
    ((host, _),) = inputs
    assert host.read_bytes() == b"the real weights"
    with pytest.raises(InputError, match="is gone"):  # its file is a link now: refused
        init_file(settings, Checkpoint(job_id=JOB, path="checkpoints/last.pt", sha256=""))


def test_markers_never_reach_a_link_in_place_of_the_log(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "output.log").symlink_to(secret)
    with pytest.raises(OSError):
        append_to_log(run / "output.log", "===== torchyard: attempt 1 =====\n")
    assert secret.read_text() == "tok_admin_secret"


def test_a_job_chosen_string_in_a_marker_cannot_run_in_a_shell(tmp_path: Path) -> None:
    """repr() switches to double quotes when the string holds a quote, and `$(…)` then
    expands wherever a shell reads the line (a start-up file the log was pointed at)."""
    proof = tmp_path / "ran"
    name = f"x' $(touch {proof}) `touch {proof}`"
    line = f"===== torchyard: event line set aside: {quoted(f'metric {name!r}: too long')} =====\n"
    script = tmp_path / "profile"
    script.write_text(f"cd {tmp_path}\n{line}")
    subprocess.run(["bash", str(script)], capture_output=True, timeout=10)
    assert not proof.exists()
    assert "\n" not in line[:-1]


def test_the_spec_is_never_written_through_a_planted_temporary_name(
    tmp_path: Path, secret: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # The old temporary name was `.spec.json.<worker pid>.tmp` (the pid is public).
    (run / f".spec.json.{os.getpid()}.tmp").symlink_to(secret)
    (run / "spec.json").symlink_to(secret)
    write_spec_file(run, {"model": {"name": "mlp"}})
    assert secret.read_text() == "tok_admin_secret"
    assert not (run / "spec.json").is_symlink()


def _ckpt(path: str, data: bytes, claimed_sha: str | None, claimed_bytes: int) -> CheckpointEvent:
    return CheckpointEvent(type="checkpoint", time=0.0, step=1, epoch=0, path=path,
                           bytes=claimed_bytes, sha256=claimed_sha)  # fmt: skip


def test_a_checkpoint_is_recorded_as_measured_not_as_claimed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "a.pt").write_bytes(b"12345")
    (run / "checkpoints" / "b.pt").write_bytes(b"abc")
    real = hashlib.sha256(b"12345").hexdigest()
    rec = EventRecorder(JOB, 1, 1, measure=lambda rel: beneath.hash_file(run, rel))
    rec.checkpoints = [
        _ckpt("checkpoints/a.pt", b"12345", None, 10**12),  # no sha, a size it made up
        _ckpt("checkpoints/b.pt", b"abc", "0" * 64, 3),  # a sha256 the bytes do not have
        _ckpt("checkpoints/gone.pt", b"", "1" * 64, 1),
    ]
    rec._measure()
    (a,) = rec.checkpoints
    assert (a.path, a.sha256, a.bytes) == ("checkpoints/a.pt", real, 5)
    assert rec.set_aside.count == 1  # the lie; the file gone meanwhile is only skipped
    assert "does not match" in " ".join(rec.set_aside.notes)


@pytest.mark.skipif(not ROOT, reason="another uid for the job needs a root worker")
def test_a_root_workers_run_dir_lets_the_job_replace_none_of_the_workers_files() -> None:
    top = Path(tempfile.mkdtemp(prefix="ty-rundir-"))  # pytest's tmp is 0700: not the job's way
    top.chmod(0o755)
    try:
        _job_against_its_run_dir(top / "run")
    finally:
        shutil.rmtree(top)


def _job_against_its_run_dir(run: Path) -> None:
    run.mkdir()
    write_spec_file(run, {"model": {"name": "mlp"}})
    append_to_log(run / "output.log", "===== torchyard: attempt 1 =====\n")
    (run / "checkpoints").mkdir()
    give_run_dir(run, (64123, 64123))
    job = (
        "import os, sys\n"
        "os.chdir(sys.argv[1])\n"
        "open('events.jsonl', 'w').write('{}\\n')\n"  # its own files: as ever
        "os.makedirs('checkpoints/x', exist_ok=True)\n"
        "refused = 0\n"
        "for act in (lambda: os.unlink('output.log'), lambda: os.rename('output.log', 'o'),\n"
        "            lambda: os.rename('events.jsonl', 'output.log'),\n"
        "            lambda: open('output.log', 'a'), lambda: os.unlink('spec.json'),\n"
        "            lambda: open('spec.json', 'w')):\n"
        "    try:\n"
        "        act()\n"
        "    except PermissionError:\n"
        "        refused += 1\n"
        "print(refused)\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=64123", "--regid=64123", "--clear-groups", sys.executable, "-c",
         job, str(run)], capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "6"
    assert (run / "output.log").read_text() == "===== torchyard: attempt 1 =====\n"
    assert os.stat(run / "output.log").st_uid == 0
    append_to_log(run / "output.log", "===== torchyard: trainer exited 0 =====\n")


def test_the_jobs_private_code_counts_in_the_run_dir_limit(tmp_path: Path) -> None:
    run, code = tmp_path / "run", tmp_path / "code"
    run.mkdir()
    code.mkdir()
    (run / "a").write_bytes(b"x" * 600_000)
    (code / "b").write_bytes(b"x" * 600_000)
    assert run_dir_over(run, 1_000_000) is None
    assert run_dir_over(run, 1_000_000, also=(code,)) is not None
