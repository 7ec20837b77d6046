"""The trainer's sandbox: what a job's code may see and be, as a bubblewrap (`bwrap`) command.

A trainer runs user code (bundles, scripts, factories) and built-in code alike in a fresh
mount, PID, IPC and UTS namespace that shows it only:

- the system (`/usr` and its links, a short list of `/etc` files) and the Python it runs
  on, with torchyard's own packages, read-only, at their host paths (so argv and imports
  are the same as outside);
- its own run directory, writable, at `/job` (its cwd when it has no code);
- its own private copy of its code bundle at `/code` (made for each attempt, so nothing
  written there reaches another job or a later attempt), and its inputs (init weights, a
  resume file from elsewhere) read-only under `/inputs`;
- the data root, read-only, at its host path; its lease file, read-only, at
  `/run/torchyard/lease`;
- a private `/tmp` and `/dev/shm`, a `/proc` of its own PID namespace (no worker, no
  other job), the GPUs' device files.

Not `TORCHYARD_HOME` (admin token, database, other jobs, bundle cache), not the repository
it was installed from (`.env`, `.git`), not the worker's environment: the environment is
built from an allow-list (`sandbox_env`).

Identity: a worker running as root runs each user's trainers as an unprivileged host uid of
that user's own (store/sandboxuids.py: after `TORCHYARD_SANDBOX_UID`, never root, never the
worker's, never another user's) with no capabilities and `no_new_privs`; the run directory
and private copies are handed to that uid. Every trainer runs under a seccomp filter
(worker/seccomp.py) and in a tasks-limited cgroup (worker/cgroups.py). A worker
running as an ordinary user runs them as uid 1000 of a user namespace of their own, with no
capabilities. The network is the host's (DDP across hosts needs it): the broker and the
database must require a password, which the trainer never gets.

Why bubblewrap: it is small, packaged everywhere (Debian `bubblewrap`), used by Flatpak,
needs no daemon and no image, and starts in milliseconds, so a warm slot keeps its
first-step latency. `support()` says whether this host can run it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from torchyard.storage import beneath
from torchyard.worker import seccomp
from torchyard.worker.runfiles import worker_owned

log = logging.getLogger(__name__)

JOB = Path("/job")
CODE = Path("/code")
INPUTS = Path("/inputs")
LEASE = Path("/run/torchyard/lease")
RUN_DIR_MODE = 0o1770  # a root worker's run dir: the worker's, the sandbox user's group, sticky
USERNS_UID = 1000  # the trainer's uid inside its own user namespace (non-root workers)

# /etc entries a Python trainer needs (loader, names, TLS roots, time zone); nothing else of
# /etc (shadow, the host's configuration, an admin's env files) is shown.
ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "gai.conf",
    "resolv.conf",
    "localtime",
    "protocols",
    "services",
    "ssl",
    "ca-certificates",
    "alternatives",
)
SYSTEM_DIRS = ("/usr", "/opt")
MERGED_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
GPU_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "dri")

# The trainer's environment: these names and prefixes pass from the worker's environment,
# the worker adds its own TORCHYARD_* (worker/proc.py), nothing else crosses.
ENV_NAMES = frozenset({"LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONHASHSEED", "TERM"})
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "NVIDIA_", "CUDA_")


@dataclass(frozen=True)
class Support:
    """Whether this host can sandbox trainers, and why not."""

    ok: bool
    why: str = ""


@dataclass(frozen=True)
class Identity:
    """Who the trainer is: a host uid/gid to drop to (root workers) or a user namespace."""

    uid: int
    gid: int
    drop: bool  # True: setpriv to uid/gid on the host; False: uid inside a user namespace

    def owns(self) -> tuple[int, int] | None:
        """The owner to give the run directory and private copies (None: keep the worker's)."""
        return (self.uid, self.gid) if self.drop else None


def identity(sandbox_uid: int) -> Identity:
    if os.geteuid() == 0:
        return Identity(sandbox_uid, sandbox_uid, drop=True)
    return Identity(USERNS_UID, USERNS_UID, drop=False)


@dataclass
class Mounts:
    """The job-specific part of the sandbox (host path -> sandbox path)."""

    run_dir: Path
    code: Path | None = None
    inputs: list[tuple[Path, Path]] = field(default_factory=list)  # read-only files
    data: Path | None = None
    lease: Path | None = None
    host_network: bool = True  # False: a network namespace of its own (loopback only)


@cache
def support() -> Support:
    """Can this host run `bwrap` with the namespaces we ask for? Tried once per process."""
    exe = shutil.which("bwrap")
    if exe is None:
        return Support(False, "bwrap is not installed (Debian: apt-get install bubblewrap)")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return Support(False, "setpriv (util-linux) is missing: cannot drop root")
    nobody = identity(65534)
    try:
        with seccomp.filter_fd() as fd:  # the filter too: one the kernel refuses fails here
            probe = [*_base_args(nobody), *_seccomp_args(fd), *_system_args()]
            probe += ["--", *_drop(nobody), "/bin/true"]
            fds = () if fd is None else (fd,)
            r = subprocess.run(probe, capture_output=True, timeout=20, pass_fds=fds)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Support(False, f"bwrap could not start ({e})")
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip()[-300:]
        return Support(False, f"bwrap failed here ({err or r.returncode}): no user namespaces?")
    return Support(True)


def say_sandbox(settings: Any) -> None:
    """The worker's line at start about how its trainers are confined."""
    if settings.sandbox == "off":
        log.warning("TORCHYARD_SANDBOX=off: trainers run with this worker's rights (user code too)")
        return
    ok = support()
    if ok.ok:
        who = identity(settings.sandbox_uid)
        base = settings.sandbox_uid
        as_ = (
            f"each user's own uid from {base + 1}" if who.drop
            else f"uid {who.uid} of a user namespace"
        )  # fmt: skip
        log.info("trainers run sandboxed (bubblewrap, seccomp, as %s)", as_)
    else:
        log.warning(
            "this host cannot sandbox trainers: %s. Built-in jobs run unsandboxed; jobs that "
            "run user code are refused here unless an admin sets TORCHYARD_SANDBOX=off",
            ok.why,
        )


def _base_args(ident: Identity) -> list[str]:
    args = [
        "bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "torchyard-job",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--tmpfs",
        "/run",
    ]
    if _has_mqueue():  # the IPC namespace's POSIX queues, listed: the zygote empties them
        args += ["--mqueue", "/dev/mqueue"]
    if not ident.drop:
        args += ["--unshare-user", "--uid", str(ident.uid), "--gid", str(ident.gid)]
        args += ["--cap-drop", "ALL"]
    return args


@cache
def _has_mqueue() -> bool:
    """The kernel has POSIX message queues (without, mq_open fails and none can be left)."""
    try:
        return "\tmqueue\n" in Path("/proc/filesystems").read_text()
    except OSError:
        return False


def _seccomp_args(fd: int | None) -> list[str]:
    return [] if fd is None else ["--seccomp", str(fd)]


def _drop(ident: Identity) -> list[str]:
    """The inner command's prefix that makes a root worker's trainer an unprivileged user."""
    if not ident.drop:
        return []
    return [
        "setpriv",
        f"--reuid={ident.uid}",
        f"--regid={ident.gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@cache
def _system_args() -> tuple[str, ...]:
    """The system and the Python stack, read-only at their host paths."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for name in MERGED_USR_LINKS:
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC:
        p = Path("/etc") / name
        if p.exists():
            args += ["--ro-bind", str(p), str(p)]
    dirs = sorted(python_dirs())
    args += _parents(dirs)
    for d in dirs:
        args += ["--ro-bind", d, d]
    return tuple(args)


def _parents(paths: list[str]) -> list[str]:
    """Make the folders above bind targets searchable (bwrap would make them 0700, which a
    sandbox user other than root could not pass)."""
    out: list[str] = []
    seen: set[str] = set()
    for p in paths:
        parts = Path(p).parents
        for parent in sorted((str(q) for q in parts if str(q) != "/"), key=len):
            if parent not in seen and not parent.startswith(SYSTEM_DIRS):
                seen.add(parent)
                out += ["--perms", "0755", "--dir", parent]
    return out


def python_dirs() -> set[str]:
    """Where this interpreter, its libraries and torchyard's packages live, outermost only
    (a folder inside another is covered by it). Never a whole repository checkout: an
    editable install maps each package folder, and only those are shown."""
    found = {
        os.path.realpath(p)
        for p in (
            sys.prefix,
            sys.base_prefix,
            sys.exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable)),
            sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"],
        )
    }
    found |= {os.path.realpath(p) for p in _torchyard_dirs()}
    found = {p for p in found if os.path.isdir(p) and not p.startswith(SYSTEM_DIRS)}
    return {p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)}


def _torchyard_dirs() -> list[str]:
    """The folders of the packages a trainer imports of ours (found, not imported)."""
    dirs: list[str] = []
    for name in ("torchyard", "torchyard.trainer", "torchyard.contracts"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)
    return dirs


def _gpu_args() -> list[str]:
    args: list[str] = []
    dev = Path("/dev")
    for p in sorted(dev.glob("nvidia[0-9]*")):
        args += ["--dev-bind", str(p), str(p)]
    for name in GPU_DEVICES:
        if (dev / name).exists():
            args += ["--dev-bind", str(dev / name), str(dev / name)]
    if Path("/sys").is_dir():
        args += ["--ro-bind", "/sys", "/sys"]
    return args


def sandbox_argv(inner: list[str], mounts: Mounts, ident: Identity,
                 seccomp_fd: int | None = None) -> list[str]:  # fmt: skip
    """The whole command: bwrap, its mounts, then `inner` (the trainer's argv, its paths
    already the sandbox's: `sandbox_path`) as the sandbox's user, in /job, under the
    seccomp filter read from `seccomp_fd` (worker/seccomp.py filter_fd; the caller passes
    the descriptor on)."""
    args = [*_base_args(ident), *_seccomp_args(seccomp_fd), *_system_args(), *_gpu_args()]
    args += ["--bind", str(mounts.run_dir), str(JOB)]
    if mounts.code is not None:
        # Its own copy, made for this attempt: writable (a script may write beside itself,
        # its cwd), and nothing written there outlives the attempt or reaches another job.
        args += ["--bind", str(mounts.code), str(CODE)]
    for host, inside in mounts.inputs:
        args += [*_parents([str(inside)]), "--ro-bind", str(host), str(inside)]
    if mounts.data is not None:
        # Made if missing (a standby's mounts are fixed at its start, data sets come later),
        # and passable by the sandbox's user whatever the service's umask (store/dataimport.py
        # makes what it imports readable by all).
        mounts.data.mkdir(parents=True, exist_ok=True)
        if ident.drop:
            os.chmod(mounts.data, os.stat(mounts.data).st_mode | 0o755)
        args += [*_parents([str(mounts.data)]), "--ro-bind", str(mounts.data), str(mounts.data)]
    if mounts.lease is not None:
        args += ["--perms", "0755", "--dir", str(LEASE.parent)]
        args += ["--ro-bind", str(mounts.lease), str(LEASE)]
    if not mounts.host_network:
        args += ["--unshare-net"]
    args += ["--chdir", str(JOB), "--", *_drop(ident), *inner]
    return args


def sandbox_env(env: dict[str, str], python_bin: str) -> dict[str, str]:
    """The trainer's environment inside: the allow-list of the worker's, the worker's own
    TORCHYARD_* settings for the trainer, and a plain identity. Paths that point outside
    the sandbox (the lease file) are rewritten to where it sees them."""
    out = {
        k: v
        for k, v in env.items()
        if k in ENV_NAMES or k.startswith(ENV_PREFIXES) or k in TRAINER_SETTINGS
    }
    if "TORCHYARD_LEASE_FILE" in out:
        out["TORCHYARD_LEASE_FILE"] = str(LEASE)
    out.update(
        PATH=f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
        HOME="/tmp",
        USER="trainer",
        LOGNAME="trainer",
        TMPDIR="/tmp",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",  # the packages are read-only; no stray .pyc attempts
    )
    return out


# What the worker itself sets for a trainer (worker/proc.py trainer_env, the watchdog's
# lease): these pass; any other TORCHYARD_* of the worker's environment does not. Not
# TORCHYARD_DIE_WITH_PARENT: inside, the parent is the sandbox's init (pid 1), and the
# namespace already dies with bwrap, which dies with the worker.
TRAINER_SETTINGS = frozenset(
    {
        "TORCHYARD_ATTEMPT",
        "TORCHYARD_DATA_ROOT",
        "TORCHYARD_COLLECTIVE_TIMEOUT_S",
        "TORCHYARD_LEASE_FILE",
        "TORCHYARD_LEASE_STOP_S",
        "TORCHYARD_LEASE_KILL_S",
        "TORCHYARD_MAX_MODEL_PARAMS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "PYTHONUNBUFFERED",
    }
)


def give_to(path: Path, owner: tuple[int, int] | None) -> None:
    """Hand a folder tree the worker prepared to the sandbox's user (root workers), links
    themselves and never their targets, walked by descriptor (storage/beneath.py)."""
    if owner is None:
        return
    beneath.chown_tree(path, *owner)


def give_run_dir(path: Path, owner: tuple[int, int] | None) -> None:
    """A run directory for the sandbox's user (root workers): its tree is the user's but
    for the worker's own files (the log, the spec: `worker_owned`), and the folder itself
    stays the worker's, writable by the user's group and sticky, so the job creates and
    replaces its own files there but can neither rename, replace nor remove the worker's."""
    if owner is None:
        return
    uid, gid = owner
    beneath.chown_tree(path, uid, gid, keep=worker_owned)
    fd = beneath.open_dir(path)
    try:
        os.fchown(fd, os.geteuid(), gid)
        os.fchmod(fd, RUN_DIR_MODE)
    finally:
        os.close(fd)
