"""Hostile local users (issue 42): `scripts/demo.sh` and `torchyard up` never leave the
admin token where another user of the machine can read it. demo.sh runs here as the
README says, in a copy of the repository whose `.venv` is already installed (this
interpreter) and whose `torchyard` is the real one for `up` (API and scheduler, no worker)
and stops the demo at `submit`; the home is an older run's, open to all (0755, its up.log
0644 holding a token). Once `up` started: the home is 0700, up.log and admin-token 0600."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hostile

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "sh", "cat", "grep", "mkdir", "rm", "dirname", "sleep", "env")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _repo(tmp: Path) -> Path:
    """scripts/demo.sh with an installed .venv: its stamp matches, so no pip runs."""
    repo = tmp / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    for f in ("pyproject.toml", "constraints.txt"):
        (repo / f).write_text(f"{f}\n")
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    stamp = hashlib.sha256(b"pyproject.toml\nconstraints.txt\n").hexdigest()
    (repo / ".venv" / ".torchyard-demo-installed").write_text(stamp + "\n")
    cli = venv / "torchyard"
    cli.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = up ] && shift && exec {sys.executable} -m torchyard up --cpu --workers 0 "$@"\n'
        'echo "stopped at: torchyard $*" >&2; exit 3\n'
    )
    cli.chmod(0o755)
    return repo


def _path(tmp: Path) -> str:
    """Only what demo.sh needs: no npm, so no dashboard build."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_ / tool).symlink_to(found)
    return str(bin_)


def test_the_demo_keeps_the_token_from_other_users(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    home = repo / ".torchyard"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    (home / "up.log").write_text("admin token:\n  ty_an_older_runs_token\n")
    (home / "up.log").chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(PATH=_path(tmp_path), HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "cfg"),
               TORCHYARD_PORT=str(_free_port()))  # fmt: skip
    old = os.umask(0o022)  # a usual login's mask
    try:
        p = subprocess.run(["bash", "scripts/demo.sh"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    finally:
        os.umask(old)
    assert "stopped at: torchyard submit" in p.stderr, p.stdout + p.stderr
    log = (home / "up.log").read_text()
    assert "torchyard is up" in log and (home / "admin-token").read_text().strip() in log
    for path, mode in ((home, 0o700), (home / "up.log", 0o600), (home / "admin-token", 0o600)):
        assert path.stat().st_mode & 0o777 == mode, f"{path}: {oct(path.stat().st_mode)}"
