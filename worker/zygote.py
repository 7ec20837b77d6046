"""The worker's end of a sandboxed slot's zygote (trainer/zygote.py): one warm trainer
inside one bubblewrap sandbox that runs the slot's jobs one after another, each in a fork
of its own, so a sweep's trials and a user's queue of small jobs stop paying `import
torch` (~5 CPU-s on this 2-core host: three slots refilling at once left trials waiting
3-6 s for a trainer).

`Zygote` holds the sandbox (bwrap's process, its init's pid), the Unix socket it reads its
jobs from, the folder bound at its `/job` (wherever that folder is named now: see
worker/launch_sandbox.py for how a run directory takes it over and gives it back), and
whose jobs it has served. `ZygoteTrainer` is the job's handle (worker/launcher.py
TrainerHandle): the forked child's host pid (signalled through a pidfd, so a reused pid
is never hit), its return code as the zygote reports it, or SIGKILL when the whole
sandbox died under it.

What keeps jobs apart, checked here rather than taken on the zygote's word: the zygote
serves a job only when the sandbox holds nothing but its init and the zygote (`clean`,
read from the host's /proc), and one zygote never serves two users (`tenant`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from torchyard.worker.launch_local import OomCount, oom_rose, signal_group
from torchyard.worker.logpump import LogPump
from torchyard.worker.standby import ReadyPump

log = logging.getLogger(__name__)

MAX_REPLY = 256
END_WAIT_S = 5.0  # a sandbox SIGKILLed is reaped at once
SETTLE_S = 1.0  # for init to reap what the zygote killed


def children(pid: int) -> list[int]:
    """`pid`'s child processes, from the host's /proc ([] once it is gone)."""
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def folder_identity(path: Path) -> tuple[int, int] | None:
    """A folder's (device, inode): what it is, whichever name it goes by now."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the worker's end, the zygote's end: its fd 0). Message boundaries are kept, and
    the log pipe travels with its go message."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Zygote:
    """One sandboxed zygote. Its socket is read under a lock (the supervision loop and the
    watchdog thread both poll the job's handle)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket,
                 init_pid: int | None, folder: Path):  # fmt: skip
        self.proc = proc  # bwrap: the sandbox's process group
        self.sock = sock
        self.init_pid = init_pid
        self.folder = folder  # the folder bound at /job, under its current name
        self.folder_id = folder_identity(folder)  # what /job binds, whatever its name
        self.owns_folder = True  # False while a run directory's name holds it
        self.tenant: int | None = None  # the user whose jobs it has served
        self.uid: int | None = None  # the host uid it runs as (its user's, or no user's)
        self.pump: ReadyPump | None = None  # its own output (the worker's stderr)
        self.rc: int | None = None  # the current job's return code, once reported
        self.busy = False
        self.host_pid: int | None = None  # the zygote's own pid, as found at its last job
        self._lock = threading.Lock()

    @property
    def zygote_pid(self) -> int | None:
        """The zygote's host pid: the sandbox init's one child."""
        kids = children(self.init_pid) if self.init_pid is not None else []
        return kids[0] if len(kids) == 1 else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def holds(self, path: Path) -> bool:
        """`path` names the folder bound at this zygote's /job. Not so once another
        worker's attempt took the run directory over (this worker frozen or cut off past
        its lease): the name is then that attempt's, not this worker's to touch."""
        return self.folder_id is not None and folder_identity(path) == self.folder_id

    def clean(self) -> bool:
        """Nothing runs in the sandbox but its init and an idle zygote: every process there
        descends from init, so init with one child that has none is all there is."""
        if not self.alive() or self.init_pid is None:
            return False
        deadline = time.monotonic() + SETTLE_S
        while True:  # what the zygote killed may still wait for init to reap it
            kids = [k for k in children(self.init_pid) if not _dead(k)]
            if len(kids) == 1 and not [k for k in children(kids[0]) if not _dead(k)]:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def start(self, go: dict[str, object], out_fd: int, timeout: float) -> int | None:
        """Send the job with its log pipe; the child's host pid once the zygote forked it,
        None if it did not (then the zygote is not to be used again)."""
        zygote = self.host_pid = self.zygote_pid
        try:
            socket.send_fds(self.sock, [json.dumps(go).encode()], [out_fd])
            reply = self._read(timeout)
        except OSError as e:
            log.warning("warm trainer did not take its job (%s)", e)
            return None
        if reply is None or not reply.startswith("started "):
            log.warning("warm trainer did not start its job (%r)", reply)
            return None
        self.rc, self.busy = None, True
        inner = int(reply.split()[1])
        for kid in children(zygote) if zygote is not None else []:
            if _inner_pid(kid) == inner:
                return kid
        return zygote  # it has already exited: its code comes next

    def poll(self) -> int | None:
        """The running job's return code once the zygote reported it, or -SIGKILL once the
        sandbox is gone without a report (the namespace died, and the job with it)."""
        if self.rc is not None or not self.busy:
            return self.rc
        reply = self._read(0.0)
        if reply is not None and reply.startswith("exit "):
            self.rc, self.busy = int(reply.split()[1]), False
        elif not self.alive():
            self.rc, self.busy = -signal.SIGKILL, False
        return self.rc

    def stopped(self) -> bool:
        """The zygote is stopped (SIGSTOP from its job, the same uid, or traced): it will
        not reap its job nor report it until continued, which may be never."""
        if self.host_pid is None:
            return False
        try:
            stat = Path(f"/proc/{self.host_pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def _read(self, timeout: float) -> str | None:
        with self._lock:
            if self.sock.fileno() < 0:  # ended
                return None
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            data = self.sock.recv(MAX_REPLY)
        return data.decode(errors="replace").strip() or None

    def end(self) -> None:
        """SIGKILL the sandbox (the namespace and everything in it goes) and reap it."""
        signal_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(END_WAIT_S)
        with contextlib.suppress(OSError):
            self.sock.close()


def _dead(pid: int) -> bool:
    """A zombie (dead, not yet reaped) or gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def _inner_pid(host_pid: int) -> int | None:
    """A process's pid in its innermost PID namespace (the last of /proc status NSpid)."""
    try:
        for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


class ZygoteTrainer:
    """A job run by a zygote's fork (`TrainerHandle`)."""

    def __init__(self, zygote: Zygote, child: int, log_path: Path, oom_before: int | None,
                 pump: LogPump, oom_count: OomCount):  # fmt: skip
        self.zygote = zygote
        self._pid = child
        self._log_path = log_path
        self._oom_before = oom_before
        self._oom_count = oom_count
        self._pump: LogPump | None = pump
        self._pidfd: int | None = None
        self.writable: tuple[Path, ...] = ()  # folders besides the run dir it may write
        if child != zygote.zygote_pid:
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(child)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def poll(self) -> int | None:
        rc = self.zygote.poll()
        if rc is None and self._exited() and self.zygote.stopped():
            # Its job has exited, and the zygote that would report it was stopped (by the
            # job: a job that stops its zygote ends only itself): the sandbox is ended, and
            # with it whatever the job left; the slot gets a new zygote.
            log.warning("the warm trainer was stopped under its job; its sandbox is ended")
            self.zygote.end()
            rc = self.zygote.poll()
        if rc is not None:
            self._ended()
        return rc

    def _exited(self) -> bool:
        """The job's process has exited (its pidfd is readable), or is not known by one."""
        if self._pidfd is None:
            return True
        try:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["trainer --zygote"], timeout or 0.0)
            time.sleep(0.02)
        return rc

    def _ended(self) -> None:
        """Its output is all in the log (every process of the job is gone: the pipe has
        ended), and its pidfd closed."""
        if self._pump is not None:
            self._pump.join(2.0)
            self._pump = None
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def terminate(self) -> None:
        fd = self._pidfd
        if fd is None or self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(fd, signal.SIGTERM)

    def kill(self) -> None:
        """The whole sandbox: the job, whatever it started, and the zygote (a new one
        starts cold, for the next job). Nothing once the zygote reported the job's end: it
        reports only once the job's processes are all gone."""
        if self.poll() is None:
            self.zygote.end()

    def oom_killed(self) -> bool:
        return oom_rose(self._oom_before, self._oom_count)
