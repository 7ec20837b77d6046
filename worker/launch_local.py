"""The `local` launcher (worker/launcher.py): the trainer as a process on this host, in its own
process group and session, killed with the worker (parent-death signal), its output appended
straight to the job log; a one-rank job goes to the slot's warm standby (worker/standby.py)
when there is a live one. Also the process primitives the standby starts and stops its own
process with.

OOM evidence is the kernel's host-wide count of OOM kills (`/proc/vmstat`), read at the
start and again when asked (`oom_kills`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from torchyard.contracts.parent import die_with_parent
from torchyard.settings import Settings
from torchyard.worker.launcher import LaunchRequest, Standby
from torchyard.worker.proc import go_message

NAME = "local"


VMSTAT = Path("/proc/vmstat")


def oom_kills(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of OOM kills (Linux 4.13+), or None where it cannot be read.
    A trainer that died of SIGKILL while this count rose was the OOM killer's victim (the
    count is host-wide: another process's OOM kill at the same moment would be taken for
    the trainer's, which only costs that job its retry)."""
    try:
        for line in vmstat.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when the worker's thread that
    started it dies, and bail out if the worker is already gone."""
    die_with_parent(signal.SIGKILL)  # off Linux: the process group kill still applies
    if os.getppid() != parent_pid:
        os._exit(1)


def spawn(
    argv: list[str], *, env: dict[str, str], cwd: Path, log_fd: int, stdin: int = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """Start the trainer in its own session (so a signal reaches it and its children), its
    stdout and stderr appended straight to the job log (no copying through the worker).
    A fresh interpreter (fork+exec, nothing of the threaded worker carried over). Call from
    the worker's main thread: the parent-death signal follows the calling thread."""
    parent = os.getpid()
    return subprocess.Popen(
        argv,
        env=env,
        cwd=str(cwd),
        stdin=stdin,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent),
        close_fds=True,
    )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the trainer's whole process group (torchrun and its ranks alike)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalTrainer:
    """A trainer process on this host (`TrainerHandle`), started cold or by a standby."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, oom_before: int | None):
        self.proc = proc
        self._log_path = log_path
        self._oom_before = oom_before  # the host's OOM kill count before it started

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.proc, signal.SIGKILL)

    def oom_killed(self) -> bool:
        after = oom_kills()
        return self._oom_before is not None and after is not None and after > self._oom_before


class LocalLauncher:
    """Starts trainers as local process groups (`Launcher`). Call `start` from the worker's
    main thread: the parent-death signal follows the thread that spawned."""

    name = NAME

    def __init__(self, standby: Standby | None = None):
        self.standby = standby

    def start(self, request: LaunchRequest) -> LocalTrainer:
        """The slot's warm trainer for one rank when there is a live one, else a cold start."""
        oom_before = oom_kills()
        # Opened here either way: a log that cannot be opened fails the launch, as always.
        fd = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            proc = None
            if self.standby is not None and request.warm_ok:
                go = go_message(request.launch, request.env, request.log_path)
                proc = self.standby.hand_over(go)
            if proc is None:
                proc = spawn(request.argv, env=request.env, cwd=request.cwd, log_fd=fd)
        finally:
            os.close(fd)
        return LocalTrainer(proc, request.log_path, oom_before)


def create_launcher(settings: Settings, standby: Standby | None) -> LocalLauncher:
    """The registry's factory (worker/launcher.py LAUNCHERS)."""
    return LocalLauncher(standby)
