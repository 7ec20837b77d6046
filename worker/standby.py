"""The worker's warm trainer, part of the `local` launcher (worker/launch_local.py): one
`python -m torchyard.trainer --standby` per worker slot, started ahead of its job (pinned
like a trainer, torch imported, nothing else initialised), so a one-rank job's first step
does not wait for the interpreter and `import torch`.

A job takes it (`hand_over`, called by its launcher): its output, which went to the
worker's stderr through a capped pipe (worker/logpump.py), now goes to the job's log, the
go message (worker/proc.py go_message) is written and its stdin closed, and from then on it
is that job's trainer process, exactly as a cold one. How it is started (a plain process,
or inside the sandbox: worker/launch_sandbox.py) is its launcher's `starter`. The worker starts the next one (`refill`)
when that job's trainer has exited, not beside it, so the import never competes with a
running job for its cores. A standby that died idle (OOM, killed), or was started under
another environment, is discarded and the job starts cold. Every start is from the
worker's main thread (the parent-death signal follows the thread that spawned), with a
fresh interpreter: never a fork of the worker.

Readiness costs nothing extra: once its imports are done the standby writes one line on
its output (trainer/standby.py READY_LINE), which its log pump (`ReadyPump`) takes out of
the stream until the hand-over. `ready()` is what the worker records in its row
(`workers.warm_since`, worker/node.py) and placement prefers (scheduler/policy.py): a
standby still importing, taken, or dead (its pipe ended) is not ready.

The sandbox launcher's standby is a zygote (worker/zygote.py) that serves one job after
another: its launcher `take`s it for a job and gives it back through `reuse` once the job
has ended and the sandbox is clean, so `refill` starts nothing new.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchyard.worker.launch_local import signal_group, spawn
from torchyard.worker.logpump import LogPump
from torchyard.worker.proc import standby_argv

if TYPE_CHECKING:
    from torchyard.worker.cgroups import TrainerCgroup

log = logging.getLogger(__name__)

# What may differ between the environment a standby was started with and its job's: the
# rest (threads, pin, data root) is read at import or start, so it must already be right.
PER_JOB_ENV = frozenset({"TORCHYARD_ATTEMPT"})
CLOSE_WAIT_S = 5.0  # a standby told to stop (EOF) exits at once, or as soon as imports end
DEFAULT_LOG_BYTES = 256 * 1024**2
# trainer/standby.py READY_LINE (the worker never imports the trainer; a test keeps the two
# equal): what a standby writes once its imports are done.
READY_LINE = b"[torchyard] warm trainer ready\n"

# Starts a standby: (its environment, the write end of its output pipe) -> the process.
Starter = Callable[[dict[str, str], int], "subprocess.Popen[bytes]"]


@dataclass
class Handed:
    """A standby that took its job: the process, and the pump writing its output."""

    proc: subprocess.Popen[bytes]
    pump: LogPump


class ReadyPump(LogPump):
    """A standby's log pump that also watches for its ready line (taken out of the output)
    until the hand-over, and says when the output ended (the standby is gone)."""

    def __init__(self, read_fd: int, max_bytes: int):
        self.ready = threading.Event()
        self.ended = threading.Event()
        self._watch = True  # off from the hand-over: a job's output is never looked into
        self._since = time.monotonic()
        super().__init__(read_fd, max_bytes)

    def retarget(self, log_path: Path) -> None:
        self._watch = False
        super().retarget(log_path)

    def _write(self, data: bytes) -> None:
        if self._watch and not self.ready.is_set() and READY_LINE in data:
            data = data.replace(READY_LINE, b"", 1)
            self.ready.set()
            log.info("warm trainer ready (%.1f s)", time.monotonic() - self._since)
        if data:
            super()._write(data)

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self.ended.set()


class WarmTrainer:
    """This slot's one standby trainer. Not thread-safe: the worker's main thread only."""

    def __init__(
        self,
        env: Callable[[], dict[str, str]],
        cwd: Path | None = None,
        max_log_bytes: int = DEFAULT_LOG_BYTES,
    ):
        self._env_for = env  # the slot's trainer environment, without the per-job part
        self._cwd = cwd or Path.cwd()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: ReadyPump | None = None
        self._env: dict[str, str] = {}
        self._max_log = max_log_bytes
        self.starter: Starter = self._plain  # a launcher may set its own (the sandbox's)
        # The environment as its launcher passes it on (the sandbox's allow-list): what a
        # job's go message is compared with.
        self.view: Callable[[dict[str, str]], dict[str, str]] = dict
        self.cgroup: TrainerCgroup | None = None  # the slot's memory cgroup (its launcher's)
        # A launcher whose warm trainer outlives its job (the sandbox's zygote) gives it
        # back here, ready for the next one, instead of a new one being started.
        self.reuse: Callable[[], Handed | None] | None = None
        # How a standby is told to exit (end of its input); a launcher may set its own.
        self.end_input: Callable[[subprocess.Popen[bytes]], None] = _close_stdin

    def _plain(self, env: dict[str, str], out_fd: int) -> subprocess.Popen[bytes]:
        return spawn(
            standby_argv(),
            env=env,
            cwd=self._cwd,
            log_fd=out_fd,
            stdin=subprocess.PIPE,
            cgroup=self.cgroup,
        )

    def refill(self) -> None:
        """Start a standby if there is no live one. Failure only costs the next job the cold
        start, so it is logged, not raised."""
        if self.proc is not None:
            if self.proc.poll() is None:
                return
            log.warning(
                "warm trainer %d exited idle (%s); replacing it",
                self.proc.pid,
                self.proc.returncode,
            )
            self.proc = None
        if self.reuse is not None and (back := self.reuse()) is not None:
            assert isinstance(back.pump, ReadyPump)
            self.proc, self.pump = back.proc, back.pump  # a zygote, ready for its next job
            return
        env = self._env_for()
        r, w = os.pipe()
        try:
            # Its output goes to the worker's stderr until it takes a job's log.
            self.proc = self.starter(env, w)
        except OSError as e:
            os.close(r)
            log.warning("could not start a warm trainer (%s); jobs start cold", e)
            return
        finally:
            os.close(w)
        self.pump = ReadyPump(r, self._max_log)
        self._env = self.view(env)
        log.info("warm trainer %d started", self.proc.pid)

    def ready(self) -> bool:
        """A live standby has finished its imports and waits for a job. Safe from another
        thread (the heartbeat's): it reads two references and two flags, no system call."""
        proc, pump = self.proc, self.pump
        return (
            proc is not None
            and pump is not None
            and pump.ready.is_set()
            and not pump.ended.is_set()
            and proc.returncode is None
        )

    def hand_over(self, go: dict[str, object], log_path: Path) -> Handed | None:
        """The standby, now running the job `go` describes with its output in `log_path`;
        None when there is none ready (the caller starts the trainer cold). The standby is
        this job's from here on."""
        handed = self.take(go["env"])  # type: ignore[arg-type]
        if handed is None:
            return None
        proc, pump = handed.proc, handed.pump
        assert proc.stdin is not None
        try:
            pump.retarget(log_path)
            proc.stdin.write(json.dumps({**go, "log": ""}).encode() + b"\n")
            proc.stdin.close()
        except OSError as e:  # it died between the poll and the write, or no log
            log.warning("warm trainer %d did not take its job (%s); cold start", proc.pid, e)
            _kill(proc)
            return None
        return Handed(proc, pump)

    def take(self, env: dict[str, str]) -> Handed | None:
        """The live standby, no longer this slot's (its job's launcher gives it its job),
        if it was started for `env` (as `view` shows it); None: start cold."""
        proc, self.proc = self.proc, None
        pump, self.pump = self.pump, None
        if proc is None or pump is None:
            return None
        if proc.poll() is not None:
            log.warning("warm trainer %d had exited (%s); cold start", proc.pid, proc.returncode)
            return None
        if _base(self._env) != _base(env):
            log.info("warm trainer %d was started for another environment; cold start", proc.pid)
            _kill(proc)
            return None
        return Handed(proc, pump)

    def close(self) -> None:
        """The worker is stopping: end of input makes the standby exit 0; reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            self.end_input(proc)
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill(proc)


def _base(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_JOB_ENV}


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    proc.wait()
