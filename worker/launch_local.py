"""The `local` launcher (worker/launcher.py): the trainer as a process on this host, in its own
process group and session, killed with the worker (parent-death signal), with the worker's
rights (TORCHYARD_SANDBOX=off: worker/launch_sandbox.py is the default), its output
appended to the job log through the worker's capped pipe (worker/logpump.py); a one-rank
job goes to the slot's warm standby (worker/standby.py)
when there is a live one. Also the process primitives the standby starts and stops its own
process with.

Where the host has cgroups, every trainer of the slot (cold or warm) runs in the slot's own
memory cgroup (worker/cgroups.py), entered between fork and exec: over its limit the kernel
kills it alone, and the OOM evidence is that cgroup's own OOM-kill count. Elsewhere it is the
kernel's host-wide count (`/proc/vmstat`). Either is read at the start and again when asked."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from torchyard.contracts.parent import die_with_parent
from torchyard.settings import Settings
from torchyard.worker.cgroups import TrainerCgroup, slot_name, sweep_stale
from torchyard.worker.launcher import LaunchRequest, Standby
from torchyard.worker.logpump import LogPump, piped_log
from torchyard.worker.proc import go_message

NAME = "local"


VMSTAT = Path("/proc/vmstat")
PUMP_DRAIN_S = 2.0


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


OomCount = Callable[[], int | None]


def oom_rose(before: int | None, count: OomCount) -> bool:
    """The OOM-kill count has risen since `before` (its reading when the trainer started)."""
    after = count()
    return before is not None and after is not None and after > before


def oom_counter(cgroup: TrainerCgroup | None) -> OomCount:
    """Where a trainer's OOM kills are counted: its cgroup's own counter, else the host's."""
    return cgroup.oom_kills if cgroup is not None else oom_kills


def trainer_cgroup(settings: Settings) -> TrainerCgroup | None:
    """This worker's slot's memory cgroup, its tasks limited (None, logged, where the host
    has none for us), after the stale ones of dead workers are swept. Once per slot,
    before its standby."""
    sweep_stale()
    return TrainerCgroup.create(
        slot_name("trainer"), settings.trainer_memory_bytes, max_pids=settings.trainer_max_pids
    )


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when the worker's thread that
    started it dies, and bail out if the worker is already gone."""
    die_with_parent(signal.SIGKILL)  # off Linux: the process group kill still applies
    if os.getppid() != parent_pid:
        os._exit(1)


def spawn(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log_fd: int,
    stdin: int = subprocess.DEVNULL,
    pass_fds: tuple[int, ...] = (),
    cgroup: TrainerCgroup | None = None,
    ignore_sigterm: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the trainer in its own session (so a signal reaches it and its children), its
    stdout and stderr to `log_fd` (the write end of its log pump's pipe). A fresh interpreter (fork+exec, nothing of the threaded worker carried over). Call from
    the worker's main thread: the parent-death signal follows the calling thread."""
    parent = os.getpid()
    enter = cgroup.enter_fn() if cgroup is not None else None

    def preexec() -> None:
        if enter is not None:
            enter()  # OSError: the Popen fails, never a trainer outside its cgroup
        _die_with_parent(parent)
        if ignore_sigterm:  # inherited across exec (see worker/launch_sandbox.py _spawn)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    return subprocess.Popen(
        argv,
        env=env,
        cwd=str(cwd),
        stdin=stdin,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=preexec,
        close_fds=True,
        pass_fds=pass_fds,
    )


def start_piped(
    argv: list[str],
    request: LaunchRequest,
    pass_fds: tuple[int, ...] = (),
    cgroup: TrainerCgroup | None = None,
) -> tuple[subprocess.Popen[bytes], LogPump]:
    """A cold start with its output through a capped pump into the request's log. The log
    is opened first: a log that cannot be opened (or is a link) fails the launch."""
    pump, w = piped_log(request.max_log_bytes, request.log_path)
    try:
        proc = spawn(
            argv, env=request.env, cwd=request.cwd, log_fd=w, pass_fds=pass_fds, cgroup=cgroup
        )
    finally:
        os.close(w)
    return proc, pump


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the trainer's whole process group (torchrun and its ranks alike)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalTrainer:
    """A trainer process on this host (`TrainerHandle`), started cold or by a standby."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        log_path: Path,
        oom_before: int | None,
        pump: LogPump | None = None,
        oom_count: OomCount = oom_kills,
    ):
        self.proc = proc
        self._log_path = log_path
        self._oom_before = oom_before  # `oom_count()` before it started
        self._oom_count = oom_count
        self._pump = pump

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            self._drained()
        return rc

    def wait(self, timeout: float | None = None) -> int:
        rc = self.proc.wait(timeout)
        self._drained()
        return rc

    def _drained(self) -> None:
        """Its last output is in the log before anyone reads the log's tail (a child that
        keeps the pipe open past the trainer's end only costs this wait once)."""
        if self._pump is not None:
            self._pump.join(PUMP_DRAIN_S)
            self._pump = None

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.proc, signal.SIGKILL)

    def oom_killed(self) -> bool:
        return oom_rose(self._oom_before, self._oom_count)


class LocalLauncher:
    """Starts trainers as local process groups (`Launcher`). Call `start` from the worker's
    main thread: the parent-death signal follows the thread that spawned."""

    name = NAME

    def __init__(self, standby: Standby | None = None, cgroup: TrainerCgroup | None = None):
        self.standby = standby
        self.uses_standby = standby is not None  # worker/launcher.py uses_standby
        self.cgroup = cgroup
        if standby is not None:
            standby.cgroup = cgroup  # its standby starts in the slot's cgroup too

    def start(self, request: LaunchRequest) -> LocalTrainer:
        """The slot's warm trainer for one rank when there is a live one, else a cold start."""
        count = oom_counter(self.cgroup)
        oom_before = count()
        if self.standby is not None and request.warm_ok:
            go = go_message(request.launch, request.env, request.log_path)
            handed = self.standby.hand_over(go, request.log_path)
            if handed is not None:
                return LocalTrainer(handed.proc, request.log_path, oom_before, handed.pump, count)
        proc, pump = start_piped(request.argv, request, cgroup=self.cgroup)
        return LocalTrainer(proc, request.log_path, oom_before, pump, count)


def create_launcher(settings: Settings, standby: Standby | None) -> LocalLauncher:
    """The registry's factory (worker/launcher.py LAUNCHERS)."""
    return LocalLauncher(standby, trainer_cgroup(settings))
