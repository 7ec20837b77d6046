"""The `sandbox` launcher (worker/launcher.py), the default: every trainer, built-in or user
code, cold or warm, inside bubblewrap as worker/sandbox.py draws it.

A cold start binds the job's run directory at `/job`, a private copy of its code bundle at
`/code` (made for each attempt from the host's unpacked cache, which no sandbox sees, so
nothing a job writes can reach another job's import path), and its input files (init weights, a resume file
from elsewhere) under `/inputs`, then runs the trainer with its paths rewritten to those.

The slot's warm trainer (worker/standby.py) is a zygote (worker/zygote.py): one sandbox,
started before its first job is known, that runs one user's one-rank jobs one after another,
each in a fork. Its `/job` is a folder `.next-…` beside the run directories, its `/code` the
slot's code folder. At each hand-over the run directory's files are hard-linked into the
folder bound at `/job`, the two swap names (one atomic `renameat2(RENAME_EXCHANGE)`), and
the bundle is copied into the slot's code folder: the child sees exactly its job's files
where a cold trainer would. When the job has ended the folder leaves the same way (its files
linked into a fresh `.next-…` folder, which takes the run directory's name), and is emptied
at the next hand-over. Since links are always made before a swap, the run directory's name
holds every file at every instant: a worker killed mid-way leaves at most a tree of links
(swept at its next start), never a checkpoint outside its run. The zygote's folder is
known by its inode (`Zygote.holds`): a worker back from a freeze whose job went to another
attempt meanwhile finds that attempt's folder under the run directory's name, and leaves it. A fresh start and a resume
from the run's own checkpoint (a paused sweep trial, a preempted job on local storage) are
handed over; a job whose inputs lie elsewhere (init weights, a checkpoint fetched into the
host's cache) starts cold, since the standing sandbox can no longer gain a bind, and so
does another user's job: a zygote runs as one user's uid (worker/sandbox.py), the uid of the
user the slot last served (the slot's first, of no user), so another user's job starts cold
and the slot's next zygote is theirs.

Where the host cannot run bubblewrap (no user namespaces, no `bwrap`, macOS) the worker
says so when it starts; built-in jobs then run as `local` ones, and a job that runs user
code fails with `SandboxRefused` unless an admin set TORCHYARD_SANDBOX=off."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from functools import cache
from pathlib import Path

from torchyard.settings import Settings
from torchyard.storage import beneath, storage_for
from torchyard.worker import seccomp
from torchyard.worker.launch_local import (
    LocalTrainer,
    OomCount,
    oom_counter,
    spawn,
    start_piped,
    trainer_cgroup,
)
from torchyard.worker.launcher import LaunchRequest, SandboxRefused, Standby, TrainerHandle
from torchyard.worker.logpump import LogPump, piped_log
from torchyard.worker.proc import Launch, go_message, trainer_argv, zygote_argv
from torchyard.worker.sandbox import (
    CODE,
    INPUTS,
    JOB,
    Identity,
    Mounts,
    give_run_dir,
    give_to,
    identity,
    sandbox_argv,
    sandbox_env,
    support,
)
from torchyard.worker.standby import Handed
from torchyard.worker.zygote import (
    Zygote,
    ZygoteTrainer,
    children,
    folder_identity,
    socket_pair,
)

log = logging.getLogger(__name__)

NAME = "sandbox"
RENAME_EXCHANGE = 2
MIRROR_MAX_ENTRIES = 10_000  # run-dir entries a hand-over links; past it, start cold
READY_WAIT_S = 2.0  # a standby's sandbox is set up in milliseconds; past this, start cold
IMPORT_WAIT_S = 60.0  # a zygote taken while still importing: its answer comes after them
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2); OSError where the file system can't."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError("renameat2 is not available")
    at_cwd = -100
    if fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class SandboxTrainer(LocalTrainer):
    """A trainer inside bubblewrap: `pid` is bwrap's (the process group every process of
    the sandbox is in); SIGTERM goes to the trainer itself, the child of the sandbox's
    init, since bwrap does not pass signals on."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, oom_before: int | None,
                 pump: LogPump, init_pid: int | None, oom_count: OomCount):  # fmt: skip
        super().__init__(proc, log_path, oom_before, pump, oom_count)
        self._init_pid = init_pid
        self.writable: tuple[Path, ...] = ()  # folders besides the run dir it may write

    def poll(self) -> int | None:
        rc = super().poll()
        return None if rc is None else inner_rc(rc)

    def wait(self, timeout: float | None = None) -> int:
        return inner_rc(super().wait(timeout))

    def leader(self) -> int | None:
        """The host pid of the trainer (or torchrun) inside, once it has started."""
        if self._init_pid is None:
            return None
        kids = children(self._init_pid)
        return kids[0] if kids else None

    def terminate(self) -> None:
        leader = self.leader()
        if leader is None:  # not started inside yet: ending bwrap (SIGTERM-proof) ends it
            self.kill()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGTERM)


@cache
def _default_sigterm() -> tuple[str, ...]:
    """The prefix that gives the sandboxed command SIGTERM's default disposition back
    (coreutils' env, 8.31 and later); none where this host's env lacks the option."""
    argv = [shutil.which("env") or "/usr/bin/env", "--default-signal=TERM", "true"]
    try:
        ok = subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return tuple(argv[:2]) if ok else ()


def inner_rc(rc: int) -> int:
    """bwrap exits 128 + N when what it ran was killed by signal N (an OOM kill inside is
    137): told as the Popen code -N, as for a trainer outside (worker/launcher.py). A
    trainer's own exit code above 128 reads the same; none of ours is."""
    if 128 < rc < 128 + signal.NSIG:
        return -(rc - 128)
    return rc


def _read_info(fd: int) -> int | None:
    """bwrap's --info-fd JSON: the host pid of the sandbox's init (None: it failed)."""
    chunks = []
    try:
        while data := os.read(fd, 4096):
            chunks.append(data)
            with contextlib.suppress(ValueError):
                return int(json.loads(b"".join(chunks))["child-pid"])
    finally:
        os.close(fd)
    return None


class SandboxLauncher:
    """Starts this slot's trainers in sandboxes (`Launcher`). One per worker slot: it owns the
    slot's staging folder (the private code copy, the inputs) and its standby's `/job`."""

    name = NAME

    def __init__(self, settings: Settings, standby: Standby | None):
        self.settings = settings
        self.ident: Identity = identity(settings.sandbox_uid)  # of the sandbox being made
        # The host uid the slot's next zygote runs as, and whose it is: the user the slot
        # last served (a zygote cannot change its uid, so it serves that user alone; another
        # user's job starts cold and the next zygote is theirs). At first no user's.
        self._next: tuple[int, int | None] = (settings.sandbox_uid, None)
        root = settings.home.resolve() / "sandbox"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.staging = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        self.standby = standby
        self._zygote: Zygote | None = None  # the slot's warm trainer, idle or serving
        self.cgroup = trainer_cgroup(settings)  # every trainer and standby of the slot
        self._oom_count = oom_counter(self.cgroup)
        # Where the host cannot sandbox, every trainer starts cold (`start`): the worker
        # must not claim its slot warm (worker/launcher.py uses_standby).
        self.uses_standby = standby is not None and support().ok
        if standby is not None and self.uses_standby:
            standby.starter = self._start_standby
            standby.view = lambda env: sandbox_env(env, _bin())
            standby.reuse = self._reuse
            standby.end_input = self._end_input

    # ---- the standby --------------------------------------------------------------------

    def _runs_root(self) -> Path:
        return storage_for(self.settings).run_dir("0" * 32).parent

    def _slot_dir(self, name: str) -> Path:
        d = self.staging / name
        beneath.discard(d)
        d.mkdir(mode=0o700)
        return d

    def _start_standby(self, env: dict[str, str], out_fd: int) -> subprocess.Popen[bytes]:
        self._end_zygote()  # one that died idle, or cannot serve again
        uid, tenant = self._next
        self.ident = identity(uid)
        runs = self._runs_root()
        runs.mkdir(parents=True, exist_ok=True)
        sweep_next_folders(runs)
        nxt = Path(tempfile.mkdtemp(prefix=f"{_next_prefix()}{os.getpid()}-", dir=runs))
        give_run_dir(nxt, self.ident.owns())
        code = self._slot_dir("code")
        give_to(code, self.ident.owns())
        mounts = Mounts(run_dir=nxt, code=code, data=self.settings.data, lease=_lease(env),
                        host_network=self._host_network(1))  # fmt: skip
        inside_env = sandbox_env(env, _bin())
        ours, theirs = socket_pair()
        try:
            proc, init = self._spawn(
                zygote_argv(), mounts, inside_env, out_fd, stdin=theirs.fileno()
            )
        except BaseException:
            ours.close()
            beneath.discard(nxt)
            raise
        finally:
            theirs.close()
        self._zygote = Zygote(proc, ours, init, nxt)
        self._zygote.uid, self._zygote.tenant = uid, tenant
        return proc

    def _hand_over(self, request: LaunchRequest, oom_before: int | None) -> ZygoteTrainer | None:
        """The slot's zygote runs a one-rank job whose inputs all lie in its run directory,
        or None (start cold)."""
        launch = request.launch
        z, standby = self._zygote, self.standby
        if standby is None or z is None or standby.proc is not z.proc:
            return None
        if not inputs_in_run_dir(launch) or not self._zygote_inside(z):
            return None
        env = sandbox_env(request.env, _bin())
        refused = _refusal(z, request, self._uid(request))
        if refused is not None:
            level, why = refused
            log.log(level, "%s; cold start, a new one after", why)
            standby.take(env)
            self._end_zygote()
            return None
        handed = standby.take(env)
        if handed is None:  # dead, or started for another environment (and now ended)
            self._end_zygote()
            return None
        z.pump = handed.pump
        self.ident = identity(self._uid(request))  # the zygote's (`_refusal`)
        try:
            _empty(z.folder)  # links to the last job's files (its run dir holds them)
            mirror(launch.run_dir, z.folder)  # the run dir stays whole: a crash loses nothing
            exchange(launch.run_dir, z.folder)  # the run dir's name now holds the zygote's /job
        except OSError as e:
            log.warning("could not hand the warm trainer its run directory (%s); cold start", e)
            self._end_zygote()
            return None
        old, z.folder, z.owns_folder = z.folder, launch.run_dir, False
        beneath.discard(old)  # the old tree: its files live on as links
        try:
            give_run_dir(launch.run_dir, self.ident.owns())
            code = self._private_code(launch.code_dir, self.staging / "code")
        except OSError as e:
            log.warning("could not hand the warm trainer its code (%s); cold start", e)
            self._end_zygote()
            return None
        inside = self._inside(launch, code, [])
        go = {**go_message(inside, env, request.log_path), "log": ""}
        pump, w = piped_log(request.max_log_bytes, request.log_path)
        # One still importing answers once its imports are done (still sooner than cold).
        wait = READY_WAIT_S if handed.pump.ready.is_set() else IMPORT_WAIT_S
        try:
            child = z.start(go, w, wait)
        finally:
            os.close(w)
        if child is None:
            self._end_zygote()
            pump.join(READY_WAIT_S)
            return None
        z.tenant = request.tenant
        handle = ZygoteTrainer(z, child, request.log_path, oom_before, pump, self._oom_count)
        handle.writable = (code,) if code is not None else ()  # the disk watch counts /code
        return handle

    def _reuse(self) -> Handed | None:
        """The zygote back from its ended job, ready for the next (WarmTrainer.refill), or
        None: it is ended and a new one starts. Its `/job` leaves the last run directory's
        name the way it came in: the files are linked into a fresh folder that then takes
        the run directory's name, so that name holds every file throughout."""
        z = self._zygote
        if z is None:
            return None
        why = (
            "its job is still running" if z.poll() is None
            else "it never took a job" if z.pump is None
            else "its sandbox is not empty" if not z.clean()
            else ""
        )  # fmt: skip
        if not why and not z.holds(z.folder):
            why = "another attempt took its run directory over"
        if why:
            log.info("the warm trainer is not taken back (%s); a new one starts", why)
            self._end_zygote()
            return None
        pump = z.pump
        assert pump is not None
        runs = self._runs_root()
        nxt: Path | None = None
        made: tuple[int, int] | None = None  # the fresh folder, whatever its name becomes
        try:
            nxt = Path(tempfile.mkdtemp(prefix=f"{_next_prefix()}{os.getpid()}-", dir=runs))
            made = folder_identity(nxt)
            same_owner(z.folder, nxt)
            mirror(z.folder, nxt)
            exchange(z.folder, nxt)
            if not z.holds(nxt):
                # Another attempt took the run directory between the check and the swap:
                # its folder goes back under the name at once, ours (links) is removed.
                exchange(z.folder, nxt)
                raise OSError("another attempt took its run directory over")
        except OSError as e:
            log.warning("could not take the warm trainer's folder back (%s); a new one starts", e)
            if nxt is not None and made is not None and folder_identity(nxt) == made:
                beneath.discard(nxt)  # only ever the links it made
            self._end_zygote()
            return None
        z.folder, z.owns_folder, z.rc = nxt, True, None
        return Handed(z.proc, pump)

    def _end_zygote(self) -> None:
        z, self._zygote = self._zygote, None
        if z is None:
            return
        z.end()
        if z.owns_folder:
            beneath.discard(z.folder)

    def _end_input(self, proc: subprocess.Popen[bytes]) -> None:
        """The worker is stopping: end of input makes the idle zygote exit 0."""
        z = self._zygote
        if z is not None and z.proc is proc:
            z.sock.close()

    def _zygote_inside(self, z: Zygote) -> bool:
        """Its sandbox is set up (its mounts are made before bwrap starts the zygote in
        it): a hand-over before that could swap a folder bwrap has yet to bind."""
        if z.init_pid is None:
            return False
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            if children(z.init_pid):
                return True
            time.sleep(0.01)
        return False

    # ---- a start ------------------------------------------------------------------------

    def start(self, request: LaunchRequest) -> TrainerHandle:
        ok = support()
        if not ok.ok:
            if request.runs_code:
                raise SandboxRefused(
                    f"this worker cannot sandbox user code ({ok.why}); an admin may run "
                    "such jobs unsandboxed with TORCHYARD_SANDBOX=off"
                )
            oom_before = self._oom_count()
            proc, pump = start_piped(request.argv, request, cgroup=self.cgroup)
            return LocalTrainer(proc, request.log_path, oom_before, pump, self._oom_count)
        oom_before = self._oom_count()
        if request.warm_ok:
            warm = self._hand_over(request, oom_before)
            if warm is not None:
                return warm
        return self._cold(request, oom_before)

    def _host_network(self, world_size: int) -> bool:
        """TORCHYARD_SANDBOX_NETWORK=none gives one-rank trainers (and the zygote, which
        runs only those) a network namespace of their own; DDP ranks need the host's."""
        return self.settings.sandbox_network == "host" or world_size > 1

    def _uid(self, request: LaunchRequest) -> int:
        """The host uid the request's user's trainers run as (worker/launcher.py)."""
        return self.settings.sandbox_uid if request.sandbox_uid is None else request.sandbox_uid

    def _cold(self, request: LaunchRequest, oom_before: int | None) -> SandboxTrainer:
        launch = request.launch
        self.ident = identity(self._uid(request))
        self._next = (self._uid(request), request.tenant)  # the slot's next zygote is theirs
        give_run_dir(launch.run_dir, self.ident.owns())
        # Not the standby's code folder: it is bound into the waiting standby.
        code = self._private_code(launch.code_dir, self._slot_dir("cold-code"))
        inputs: list[tuple[Path, Path]] = []
        inside = self._inside(launch, code, inputs)
        mounts = Mounts(
            run_dir=launch.run_dir,
            code=code,
            inputs=inputs,
            data=self.settings.data,
            lease=_lease(request.env),
            host_network=self._host_network(launch.world_size),
        )
        pump, w = piped_log(request.max_log_bytes, request.log_path)
        env = sandbox_env(request.env, _bin())
        try:
            proc, init = self._spawn(trainer_argv(inside), mounts, env, w)
        finally:
            os.close(w)
        handle = SandboxTrainer(proc, request.log_path, oom_before, pump, init, self._oom_count)
        handle.writable = (code,) if code is not None else ()  # the disk watch counts /code
        return handle

    def _spawn(self, inner: list[str], mounts: Mounts, env: dict[str, str], out_fd: int,
               stdin: int = subprocess.DEVNULL) -> tuple[subprocess.Popen[bytes], int | None]:  # fmt: skip
        """bwrap, ignoring SIGTERM: it passes no signal on and its death SIGKILLs the
        sandbox, so a SIGTERM sent to every process (Slurm's scancel and time limit,
        systemd's control-group stop) would kill the trainer before its checkpoint. The
        trainer inside starts with SIGTERM's default again (`env --default-signal`) and
        checkpoints on it; the worker ends a sandbox with SIGKILL (SandboxTrainer)."""
        r, w = os.pipe()
        try:
            with seccomp.filter_fd() as filt:  # worker/seccomp.py: bwrap loads it last
                argv = sandbox_argv([*_default_sigterm(), *inner], mounts, self.ident, filt)
                argv[1:1] = ["--info-fd", str(w)]
                fds = (w,) if filt is None else (w, filt)
                proc = spawn(argv, env=env, cwd=self.staging, log_fd=out_fd, stdin=stdin,
                             pass_fds=fds, cgroup=self.cgroup, ignore_sigterm=True)  # fmt: skip
        finally:
            os.close(w)
        return proc, _read_info(r)

    def _private_code(self, code_dir: Path | None, dest: Path) -> Path | None:
        """The job's own copy of its unpacked bundle in `dest` (emptied first, the folder
        itself kept: a standby sees it through a bind), owned by the sandbox's user."""
        if code_dir is None:
            return None
        beneath.empty_dir(dest)
        beneath.copy_tree(code_dir, dest)
        give_to(dest, self.ident.owns())
        return dest

    def _inside(self, launch: Launch, code: Path | None, inputs: list[tuple[Path, Path]]) -> Launch:
        """The launch with its paths as the sandbox shows them (adds the input binds)."""
        return replace(
            launch,
            spec_path=JOB / launch.spec_path.relative_to(launch.run_dir),
            run_dir=JOB,
            code_dir=CODE if code is not None else None,
            resume=self._input(launch.resume, launch.run_dir, "resume", inputs),
            init=self._input(launch.init, launch.run_dir, "init", inputs),
        )

    def _input(self, path: Path | None, run_dir: Path, name: str,
               inputs: list[tuple[Path, Path]]) -> Path | None:  # fmt: skip
        if path is None:
            return None
        with contextlib.suppress(ValueError):
            return JOB / path.resolve().relative_to(run_dir.resolve())
        inside = INPUTS / f"{name}-{path.name}"
        host = path
        if self.ident.drop:  # a root worker's files are private: the sandbox's user gets a copy
            folder = self._slot_dir(f"inputs-{name}")
            host = folder / path.name
            beneath.copy_out(path.parent, path.name, host)
            give_to(folder, self.ident.owns())
        inputs.append((host, inside))
        return inside


def _refusal(z: Zygote, request: LaunchRequest, uid: int) -> tuple[int, str] | None:
    """Why the zygote may not take this job of host uid `uid` (log level, reason), or None."""
    if z.uid != uid:
        return logging.INFO, "the warm trainer runs as another user's uid"
    if z.tenant is not None and z.tenant != request.tenant:
        return logging.INFO, "the warm trainer served another user's jobs"
    if not z.holds(z.folder):  # never: the worker alone names the folder it owns
        return logging.WARNING, "the warm trainer's folder is not where it was left"
    if not z.clean():  # never: the zygote reports a job's end once its sandbox is empty
        return logging.WARNING, "the warm trainer's sandbox is not empty"
    return None


def inputs_in_run_dir(launch: Launch) -> bool:
    """Every file the trainer is given lies in its run directory (the standby sees only
    that): a resume from the run's own checkpoint, no init weights from elsewhere."""
    run = launch.run_dir.resolve()
    return all(p is None or p.resolve().is_relative_to(run) for p in (launch.resume, launch.init))


def mirror(src: Path, dst: Path, limit: int = MIRROR_MAX_ENTRIES) -> None:
    """`dst` (empty) gets `src`'s tree: folders made anew, everything else hard-linked
    (symlinks as themselves, never followed), by descriptor on both sides. OSError past
    `limit` entries: a job that filled its run directory with files starts cold rather
    than stall its hand-over."""
    beneath.link_tree(src, dst, limit)


def same_owner(model: Path, folder: Path) -> None:
    """`folder` (the worker's, fresh) gets `model`'s owner and mode (sticky bit included)."""
    st = os.stat(model, follow_symlinks=False)
    fd = beneath.open_dir(folder)
    try:
        os.fchmod(fd, stat.S_IMODE(st.st_mode))
        os.fchown(fd, st.st_uid, st.st_gid)
    finally:
        os.close(fd)


def _empty(folder: Path) -> None:
    """Remove what `folder` holds, the folder itself kept (a sandbox may bind it)."""
    beneath.empty_dir(folder)


def _next_prefix() -> str:
    # The host's name: on a shared disk another host's live standby folders are not ours.
    return f".next-{socket.gethostname()}-"


def sweep_next_folders(runs: Path) -> None:
    """Remove this host's standby folders whose worker is gone (killed mid-hand-over,
    a tree of links may remain: it would hold a deleted run's checkpoints' space)."""
    prefix = _next_prefix()
    with contextlib.suppress(OSError), os.scandir(runs) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                beneath.discard(entry.path)


def _bin() -> str:
    return os.path.dirname(sys.executable)


def _lease(env: dict[str, str]) -> Path | None:
    raw = env.get("TORCHYARD_LEASE_FILE")
    return Path(raw) if raw else None


def create_launcher(settings: Settings, standby: Standby | None) -> SandboxLauncher:
    """The registry's factory (worker/launcher.py LAUNCHERS)."""
    return SandboxLauncher(settings, standby)
