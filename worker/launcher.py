"""The launcher seam: where and how a trainer runs, behind one small interface (in the style
of torchx's `Scheduler`). The supervisor (worker/supervisor.py) prepares an attempt, hands a
`LaunchRequest` to a `Launcher`, and from then on talks only to the `TrainerHandle` it gets
back: poll, SIGTERM, kill the group, wait, OOM evidence. Nothing outside the launcher
modules starts or signals a trainer process.

Each backend is one module with a `create_launcher(settings, standby)` function, named in
`LAUNCHERS` and imported only when chosen (so a backend's client library loads only where it
is used). Two today: `sandbox` (worker/launch_sandbox.py: the trainer inside bubblewrap, the
default wherever the host can run it) and `local` (worker/launch_local.py: a process group
on this host with the worker's rights, for TORCHYARD_SANDBOX=off); a Kubernetes or Slurm
launcher is one more module and one more line here. `choose_launcher` picks by settings.

Whatever runs it, a trainer's output reaches its log through the worker's capped pipe
(worker/logpump.py), never by the trainer opening the log itself.

The end of a trainer is told as a Popen return code, whatever runs it: >= 0 is its exit
code, -N means it was killed by signal N (worker/outcome.py classifies that)."""

from __future__ import annotations

import importlib
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torchyard.settings import Settings
from torchyard.worker.proc import Launch

DEFAULT_LAUNCHER = "sandbox"
# name -> "module:factory"; the one place a launcher is chosen by name.
LAUNCHERS: dict[str, str] = {
    "local": "torchyard.worker.launch_local:create_launcher",
    "sandbox": "torchyard.worker.launch_sandbox:create_launcher",
}


@dataclass(frozen=True)
class LaunchRequest:
    """One rank's trainer, as prepared by the supervisor."""

    launch: Launch  # what runs (spec, run dir, resume, rank, rendezvous), for a launcher
    # that must bind or ship those paths itself
    argv: list[str]  # the command (worker/proc.py trainer_argv): never a shell
    env: dict[str, str]  # its whole environment (worker/proc.py slot_env)
    cwd: Path  # the run directory
    log_path: Path  # the job log its stdout and stderr are appended to (capped)
    warm_ok: bool = False  # a warm standby may take it (one rank only)
    max_log_bytes: int = 256 * 1024**2  # TORCHYARD_MAX_LOG_BYTES
    runs_code: bool = False  # the job runs code named by its user (contracts JobSpec.runs_code)
    # Whose job (a user's id; None: unknown): a warm trainer that served one user's job
    # never serves another's (worker/zygote.py).
    tenant: int | None = None
    # The host uid the tenant's trainers run as under a root worker's sandbox
    # (store/sandboxuids.py); None: TORCHYARD_SANDBOX_UID, no user's.
    sandbox_uid: int | None = None


class SandboxRefused(Exception):
    """The job runs user code and this worker cannot confine it: the attempt fails, not
    retried (worker/launch_sandbox.py)."""


@runtime_checkable
class TrainerHandle(Protocol):
    """A started trainer. Safe to use from the supervision loop and the watchdog thread."""

    @property
    def pid(self) -> int:
        """The process id the store records (the leader's, for a local trainer)."""
        ...

    @property
    def log_path(self) -> Path:
        """Where its output goes."""
        ...

    def poll(self) -> int | None:
        """Its return code once it has ended (see the module docstring), else None."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Block until it has ended; its return code."""
        ...

    def terminate(self) -> None:
        """SIGTERM to the leader only (the trainer, or torchrun which forwards it once): a
        second SIGTERM would make the trainer die without its checkpoint, and loader
        workers must not die under it. Nothing happens once it has ended."""
        ...

    def kill(self) -> None:
        """SIGKILL to everything it started (torchrun, its ranks, loader workers)."""
        ...

    def oom_killed(self) -> bool:
        """Evidence that the kernel's OOM killer struck while it ran."""
        ...


@runtime_checkable
class Standby(Protocol):
    """A trainer started ahead of its job on this slot (worker/standby.py), which a
    launcher may hand a one-rank job instead of starting one. A launcher that runs it
    elsewhere (the sandbox) sets `starter`."""

    proc: subprocess.Popen[bytes] | None
    starter: Callable[[dict[str, str], int], subprocess.Popen[bytes]]
    view: Callable[[dict[str, str]], dict[str, str]]
    cgroup: Any  # worker/cgroups.py TrainerCgroup | None: the slot's, set by its launcher
    # A warm trainer that outlives its job (the sandbox's zygote) comes back through
    # `reuse` (worker/standby.py Handed, or None); `end_input` tells an idle one to exit.
    reuse: Callable[[], Any] | None
    end_input: Callable[[subprocess.Popen[bytes]], None]

    def take(self, env: dict[str, str]) -> Any | None:
        """worker/standby.py Handed, no longer the slot's (its launcher gives it its job
        itself), or None: start cold."""
        ...

    def hand_over(self, go: dict[str, object], log_path: Path) -> Any | None:
        """worker/standby.py Handed (the process and its log pump), or None: start cold."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts trainers for one worker slot."""

    name: str

    def start(self, request: LaunchRequest) -> TrainerHandle:
        """The trainer, started; raises (OSError or the backend's error) when it could not
        be, which fails the launch."""
        ...


LauncherFactory = Callable[[Settings, Standby | None], Launcher]


def uses_standby(launcher: Launcher) -> bool:
    """Whether this launcher hands a one-rank job to the slot's standby (its `uses_standby`;
    one that does not say starts every trainer cold). A worker whose launcher does not never
    claims its slot warm (worker/node.py)."""
    return bool(getattr(launcher, "uses_standby", False))


def launcher_name(settings: Settings) -> str:
    """TORCHYARD_SANDBOX=off: `local`; else `sandbox` (which runs built-in jobs as `local`
    ones and refuses user code where the host cannot sandbox)."""
    return "local" if settings.sandbox == "off" else "sandbox"


def choose_launcher(settings: Settings, standby: Standby | None = None) -> Launcher:
    """This slot's launcher, as the settings say. Make it once per slot, before its standby
    starts: the launcher decides how the standby is started."""
    return make_launcher(launcher_name(settings), settings, standby)


def make_launcher(name: str, settings: Settings, standby: Standby | None = None) -> Launcher:
    """The launcher registered as `name`. `standby` is the slot's warm trainer, when the
    worker keeps one; a launcher that cannot use it ignores it."""
    try:
        target = LAUNCHERS[name]
    except KeyError:
        known = ", ".join(sorted(LAUNCHERS))
        raise ValueError(f"unknown launcher {name!r} (known: {known})") from None
    module, _, attr = target.partition(":")
    factory: LauncherFactory = getattr(importlib.import_module(module), attr)
    return factory(settings, standby)
