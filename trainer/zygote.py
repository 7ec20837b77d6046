"""`python -m torchyard.trainer --zygote`: the sandboxed slot's warm trainer that serves one
job after another (worker/zygote.py is its other end), so that no job, and no trial of a
sweep, pays `import torch` (~5 CPU-s here) once its slot has warmed up.

It imports what the standby imports (trainer/standby.py warm_up), says so on its output
(READY_LINE), then, for each job, reads one go message (trainer/standby.py `Go`) on fd 0,
a Unix socket from the worker that carries the write end of the job's log pipe along
with it, forks, and waits. The child is that job's trainer: its own session, the
log pipe as stdout and stderr, the job's run directory (the sandbox's `/job`) and
environment, then exactly `trainer.cli.main`. The zygote itself never runs a job's code.

When the child has exited the zygote ends every other process of the sandbox's PID namespace
(a daemonised child, loader workers), empties the private `/tmp` and `/dev/shm`, removes
System V IPC objects and POSIX message queues, and only then reports `exit <returncode>`:
the worker hands it the next job (worker/zygote.py checks from outside that nothing of the
last job is left) or ends it. It is not dumpable, so the job's code, running as the same
user, cannot ptrace it or read its memory; the worker never gives one zygote jobs of two
users.

End of input exits 0; SIGTERM is ignored (a SIGTERM to every process, as Slurm's scancel
sends, must reach the trainer, which checkpoints, without ending the sandbox under it).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from torchyard.contracts import exitcodes
from torchyard.trainer.cli import main as trainer_main
from torchyard.trainer.standby import Go, read_go, say_ready, warm_up

MAX_MESSAGE = 1 << 20  # a go message: spec paths and the environment
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
IPC_RMID = 0
REAP_ROUNDS = 200  # x 10 ms: a namespace that will not empty ends the zygote instead
# /dev/mqueue: the sandbox's IPC namespace's POSIX message queues (worker/sandbox.py mounts
# it), removed like files.
PRIVATE_DIRS = (Path("/tmp"), Path("/dev/shm"), Path("/dev/mqueue"))
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _send(sock: socket.socket, line: str) -> None:
    sock.sendall(line.encode())


def _others() -> list[int]:
    """Live processes of this PID namespace other than its init (1) and this zygote."""
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state not in ("Z", "X"):  # a zombie is dead; init reaps it
            pids.append(int(name))
    return pids


def end_the_rest() -> bool:
    """SIGKILL everything the job left in the namespace, until nothing is left (a process
    forking as fast as it can is outrun: each round kills all it finds). False: it would
    not empty, and this zygote must not serve again."""
    for _ in range(REAP_ROUNDS):
        pids = _others()
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        time.sleep(0.01)
    return False


def _writable(func: object, path: str, exc: object) -> None:
    """rmtree's error hook: a folder the job made unwritable or unreadable is opened up
    (it is this user's) and removed."""
    for folder in (os.path.dirname(path), path):  # /tmp itself is not ours: that one fails
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _mount_points() -> set[str]:
    """This namespace's mount points (mountinfo's fifth field, octal escapes undone)."""
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        raw = line.split()[4]
        points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return points


def _clear(folder: str, keep: set[str]) -> bool:
    """Remove what `folder` holds but the mount points in it and the folders that lead to
    them (the data root may lie under /tmp on the host: bwrap binds it at its own path)."""
    clean = True
    with os.scandir(folder) as entries:
        for entry in entries:
            path = entry.path
            if path in keep:
                continue
            if any(point.startswith(path + "/") for point in keep):
                clean = _clear(path, keep) and clean
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, onerror=_writable)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if os.path.lexists(path):
                print(f"trainer --zygote: could not remove {path}", file=sys.stderr, flush=True)
                clean = False
    return clean


def clear_private_dirs(dirs: tuple[Path, ...] = PRIVATE_DIRS) -> bool:
    """Empty the sandbox's own /tmp, /dev/shm and POSIX message queues (the next job of this
    user starts with nothing there, as a fresh sandbox would). False: something could not
    be removed."""
    keep = _mount_points()
    clean = True
    for folder in dirs:
        with contextlib.suppress(FileNotFoundError):
            clean = _clear(str(folder), keep) and clean
    return clean


def clear_sysv_ipc() -> None:
    """Remove the System V shared memory, semaphores and queues the job left in the
    sandbox's IPC namespace (they outlive their processes)."""
    kinds = (("shm", _libc.shmctl), ("sem", _libc.semctl), ("msg", _libc.msgctl))
    for kind, ctl in kinds:
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ident = int(line.split()[1])
            if kind == "sem":
                ctl(ident, 0, IPC_RMID)
            else:
                ctl(ident, IPC_RMID, None)


def _receive(sock: socket.socket) -> tuple[Go, int] | None:
    """The next job and its log pipe; None at end of input. ValueError: a bad message."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
    if not msg:
        for fd in fds:
            os.close(fd)
        return None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError("a go message carries exactly one file descriptor, the log pipe")
    try:
        go = read_go(msg)
        if go.log:
            raise ValueError("log: the output goes through the pipe sent with the message")
    except ValueError:
        os.close(fds[0])
        raise
    return go, fds[0]


def _become_child(sock: socket.socket, out_fd: int, go: Go) -> None:
    """In the forked child, before any of the job's code: its own session, dead with the
    zygote, dumpable again (its own /proc is its own), SIGTERM's default, the log pipe as
    stdout and stderr, nothing of the zygote's socket, the job's cwd and environment."""
    os.setsid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(go.run_dir)
    os.environ.clear()
    os.environ.update(go.env)


def serve(sock: socket.socket) -> Go | None:
    """Serve jobs until end of input (None, in the zygote). Returns the job in each forked
    child only, which then runs it (`main`)."""
    while True:
        try:
            got = _receive(sock)
        except ValueError as e:
            print(f"trainer --zygote: bad go message: {e}", file=sys.stderr, flush=True)
            _send(sock, f"error {exitcodes.BAD_SPEC}\n")
            continue
        if got is None:
            return None
        go, out_fd = got
        if threading.active_count() != 1:  # never fork a process with Python threads
            os.close(out_fd)
            raise SystemExit("trainer --zygote: a thread started; cannot fork safely")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_child(sock, out_fd, go)
            return go
        os.close(out_fd)
        _send(sock, f"started {pid}\n")
        _pid, status = os.waitpid(pid, 0)
        clean = end_the_rest()
        clean = clear_private_dirs() and clean
        clear_sysv_ipc()
        _send(sock, f"exit {os.waitstatus_to_exitcode(status)}\n")
        if not clean:
            raise SystemExit("trainer --zygote: the job left what could not be removed")


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=0)
    warm_up()
    # The imports' objects leave the collector's view: a child's full collection then
    # never writes to (and so copies) their pages.
    gc.freeze()
    _prctl(PR_SET_DUMPABLE, 0)  # the jobs' code, the same user, cannot ptrace it
    say_ready()
    go = serve(sock)
    if go is None:
        return 0
    return trainer_main(go.argv())
