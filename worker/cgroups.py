"""Each worker slot's trainer in a memory cgroup of its own, where the host has cgroups (v1
or v2): a child of the worker process's own memory cgroup, named `torchyard-<worker pid>-<slot>`,
with a limit (TORCHYARD_TRAINER_MEMORY_BYTES, default 90% of the worker's share: its own
cgroup's limit, else the host's memory). A trainer over it is killed by the kernel alone (v2:
its whole group, `memory.oom.group`), the worker and the other slots go on, and the cgroup's
own OOM-kill counter is the evidence that the job ended `out_of_memory` (never the
host-wide one, which any other process's OOM kill moves too).

Where the worker's cgroup is: `/proc/self/cgroup` names the path (v1: the line whose
controllers include `memory`; v2: `0::`), `/proc/self/mountinfo` where that hierarchy is
mounted and which of its folders the mount shows (its `root` field: a container's mount often
shows its own cgroup as the mount's top). The folder found must list this process in its
`cgroup.procs`, or it is not ours.

The same cgroup (v2), or a folder of the same name in v1's `pids` hierarchy, holds at most
TORCHYARD_TRAINER_MAX_PIDS tasks (`limit_pids`; threads count): a job that forks without end
gets EAGAIN at the limit, and the host's process table is never its to fill.

A trainer enters its cgroup between fork and exec (`enter_fn`, for Popen's `preexec_fn`),
so everything it starts is charged there. A host with no memory cgroup we may write to gets
no limit: `TrainerCgroup.create` says why in the log and returns None, it never raises for
that. Linux only; elsewhere there is simply no cgroup."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
PROC_MEMINFO = Path("/proc/meminfo")
PREFIX = "torchyard-"
SHARE = 0.9  # of the worker's limit: the trainer's own limit strikes before its parent's
NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
OURS = re.compile(r"torchyard-(\d+)-[A-Za-z0-9_.-]+")
WORKER_LEAF = "worker"  # v2: the leaf a worker moves itself into to delegate `memory`
KILL_ROUNDS = 5
UNLIMITED = 2**62  # a v1 limit this high is "no limit" (its default is ~2**63)


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo, the fields we use."""

    root: str  # the folder of the file system the mount shows at its top
    point: Path
    fstype: str
    superopts: frozenset[str]


@dataclass(frozen=True)
class MemoryHierarchy:
    """This process's memory cgroup: its folder, and the mount it was found under."""

    version: int  # 1 or 2
    path: Path
    mount: Path


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (`\\040`)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo file (lines it cannot read are skipped)."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        opts = frozenset(rest[2].split(","))
        mounts.append(Mount(_unescape(fields[3]), Path(_unescape(fields[4])), rest[0], opts))
    return mounts


def parse_proc_cgroup(text: str, controller: str = "memory") -> tuple[str | None, str | None]:
    """(the v1 `controller` hierarchy's path, the v2 unified path) of a /proc/<pid>/cgroup."""
    v1 = v2 = None
    for line in text.splitlines():
        hier, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        if hier == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v1, v2


def _candidates(mount: Mount, path: str) -> list[Path]:
    """Where `path` may be under `mount`: relative to the mount's root (the usual case and a
    container whose mount shows its own cgroup at the top), as given, or the top itself."""
    if ".." in Path(path).parts:  # a cgroup outside our namespace's view
        return []
    root = mount.root.rstrip("/")
    found = []
    if path == mount.root or path.startswith(root + "/"):
        found.append(mount.point / path[len(root) :].lstrip("/"))
    found += [mount.point / path.lstrip("/"), mount.point]
    return found


def _pids(folder: Path) -> list[int]:
    """The processes in a cgroup (`cgroup.procs`); [] where it cannot be read."""
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _locate(mounts: list[Mount], path: str, pid: int) -> tuple[Path, Path] | None:
    """(the folder, its mount point): the first folder a candidate names that lists `pid` as
    one of its processes."""
    for mount in mounts:
        for folder in _candidates(mount, path):
            if folder.is_dir() and pid in _pids(folder):
                return folder, mount.point
    return None


def find_memory_cgroup(
    proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO, pid: int | None = None
) -> MemoryHierarchy | None:
    """This process's memory cgroup (v1's `memory` hierarchy first: on a hybrid host the
    unified one has no memory controller), or None where there is none we can see."""
    return find_cgroup("memory", proc_cgroup, mountinfo, pid)


def find_cgroup(
    controller: str,
    proc_cgroup: Path = PROC_CGROUP,
    mountinfo: Path = PROC_MOUNTINFO,
    pid: int | None = None,
) -> MemoryHierarchy | None:
    """This process's cgroup of `controller` (`memory`, `pids`): v1's hierarchy of that
    controller first, else the unified one where it offers the controller."""
    pid = os.getpid() if pid is None else pid
    try:
        v1, v2 = parse_proc_cgroup(proc_cgroup.read_text(), controller)
        mounts = parse_mountinfo(mountinfo.read_text())
    except OSError:
        return None
    if v1 is not None:
        mine = [m for m in mounts if m.fstype == "cgroup" and controller in m.superopts]
        if (found := _locate(mine, v1, pid)) is not None:
            return MemoryHierarchy(1, *found)
    if v2 is not None:
        found = _locate([m for m in mounts if m.fstype == "cgroup2"], v2, pid)
        if found is not None and controller in _read(found[0] / "cgroup.controllers").split():
            return MemoryHierarchy(2, *found)
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str | int) -> None:
    """One write to an existing control file (never created: a missing one is an error)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def trainer_base(h: MemoryHierarchy, pid: int | None = None) -> Path:
    """The folder trainer cgroups are made in: the worker's own cgroup, or (v2) its parent
    when the worker moved itself into its leaf there."""
    pid = os.getpid() if pid is None else pid
    if h.path.name == f"{PREFIX}{pid}-{WORKER_LEAF}":
        return h.path.parent
    return h.path


def _limit_of(h: MemoryHierarchy, folder: Path) -> int | None:
    name = "memory.max" if h.version == 2 else "memory.limit_in_bytes"
    text = _read(folder / name).strip()
    if not text.isdigit() or int(text) >= UNLIMITED:  # v2 "max", v1 ~2**63, or unreadable
        return None
    return int(text)


def worker_limit(h: MemoryHierarchy) -> int | None:
    """The tightest memory limit on the worker's cgroup and its ancestors up to the mount."""
    limits, folder = [], trainer_base(h)
    while True:
        if (limit := _limit_of(h, folder)) is not None:
            limits.append(limit)
        if folder == h.mount or not folder.is_relative_to(h.mount) or folder.parent == folder:
            break
        folder = folder.parent
    return min(limits) if limits else None


def mem_total(meminfo: Path = PROC_MEMINFO) -> int:
    """The host's memory in bytes (MemTotal; the physical pages where there is no /proc)."""
    for line in _read(meminfo).splitlines():
        key, _, value = line.partition(":")
        if key == "MemTotal" and value.split() and value.split()[0].isdigit():
            return int(value.split()[0]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_limit(h: MemoryHierarchy | None = None, meminfo: Path = PROC_MEMINFO) -> int:
    """A trainer's share when TORCHYARD_TRAINER_MEMORY_BYTES is unset: 90% of the worker's
    own cgroup limit if it has one (less than the host's memory), else of the host's memory.
    The headroom keeps the trainer's own limit ahead of its parent's, so the kernel's choice
    of victim is made inside the trainer's cgroup and the worker is spared."""
    h = h if h is not None else find_memory_cgroup()
    total = mem_total(meminfo)
    cap = worker_limit(h) if h is not None else None
    return int(min(total, cap if cap is not None else total) * SHARE)


def slot_name(slot: str | int, pid: int | None = None) -> str:
    """The cgroup name of this worker's slot: `torchyard-<pid>-<slot>` (what `sweep_stale`
    recognises once the pid is dead)."""
    name = f"{PREFIX}{os.getpid() if pid is None else pid}-{slot}"
    _check_name(name)
    return name


def _check_name(name: str) -> None:
    if not NAME.fullmatch(name) or name in (".", "..") or name.endswith(f"-{WORKER_LEAF}"):
        raise ValueError(f"bad cgroup name {name!r}: letters, digits, '.', '_' and '-' only")


def _delegate_memory(base: Path, pid: int, controller: str = "memory") -> None:
    """v2: let `base`'s children have the `controller`. A cgroup with processes of its
    own may not (the no-internal-processes rule): if the worker is its only process, the
    worker moves into a leaf of its own beside its trainers'; else OSError."""
    control = base / "cgroup.subtree_control"
    if controller in _read(control).split():
        return
    try:
        _write(control, f"+{controller}")
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    if set(_pids(base)) != {pid}:
        raise OSError(
            errno.EBUSY,
            f"{base} holds other processes and does not hand `{controller}` to its "
            "children (give the worker a delegated cgroup of its own)",
        )
    leaf = base / f"{PREFIX}{pid}-{WORKER_LEAF}"
    leaf.mkdir(exist_ok=True)
    _write(leaf / "cgroup.procs", pid)
    _write(control, f"+{controller}")


class TrainerCgroup:
    """One slot's trainer memory cgroup. Made by `create`; the worker's main thread only."""

    def __init__(self, path: Path, version: int, limit_bytes: int):
        self.path = path
        self.version = version
        self.limit_bytes = limit_bytes
        self.max_pids: int | None = None  # pids.max, where set (`limit_pids`)
        # Where the pids controller lies in another hierarchy (v1; or a hybrid host's
        # unified one): the trainer's folder there, entered and removed with this one.
        self.extra: list[Path] = []

    def __repr__(self) -> str:
        return f"TrainerCgroup({str(self.path)!r}, v{self.version}, limit={self.limit_bytes})"

    @classmethod
    def create(
        cls,
        name: str,
        limit_bytes: int | None = None,
        hierarchy: MemoryHierarchy | None = None,
        max_pids: int = 0,
    ) -> TrainerCgroup | None:
        """The cgroup `name` (see `slot_name`) under the worker's own memory cgroup, with
        `limit_bytes` (None: `default_limit`) and at most `max_pids` processes and threads
        (0: no limit; `limit_pids`); made anew or taken over if it exists. None, with the
        reason logged, where the host has no memory cgroup or we may not make one.
        Make it before the slot's first trainer (or standby) starts."""
        _check_name(name)
        h = hierarchy if hierarchy is not None else find_memory_cgroup()
        if h is None:
            log.warning("no memory cgroup to use: trainers run without a memory limit of their own")
            return None
        limit = limit_bytes if limit_bytes is not None else default_limit(h)
        path = trainer_base(h) / name
        try:
            if h.version == 2:
                _delegate_memory(trainer_base(h), os.getpid())
            path.mkdir(exist_ok=True)
            cg = cls(path, h.version, limit)
            cg.set_limit(limit)
            cg._configure()
        except OSError as e:
            log.warning(
                "cannot make the trainer memory cgroup %s (%s): trainers run without a "
                "memory limit of their own",
                path,
                e,
            )
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        log.info("trainer memory cgroup %s (cgroup v%d, limit %d bytes)", path, h.version, limit)
        if max_pids:
            cg.limit_pids(name, max_pids)
        return cg

    def limit_pids(
        self, name: str, max_pids: int, hierarchy: MemoryHierarchy | None = None
    ) -> bool:
        """At most `max_pids` tasks (processes and threads) in the trainer's cgroup of the
        `pids` controller (its memory cgroup itself on v2, a folder `name` in v1's `pids`
        hierarchy): past it fork and thread creation fail with EAGAIN inside, nothing
        outside notices. False, logged, where the host offers no pids controller to us."""
        h = hierarchy if hierarchy is not None else find_cgroup("pids")
        if h is None:
            log.warning("no pids cgroup to use: trainers run without a process limit")
            return False
        same = h.version == 2 and trainer_base(h) == self.path.parent
        folder = self.path if same else trainer_base(h) / name
        try:
            if h.version == 2:
                _delegate_memory(trainer_base(h), os.getpid(), "pids")
            folder.mkdir(exist_ok=True)
            _write(folder / "pids.max", max_pids)
        except OSError as e:
            log.warning("cannot limit the trainer's processes in %s (%s)", folder, e)
            if not same:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return False
        if not same and folder not in self.extra:
            self.extra.append(folder)
        self.max_pids = max_pids
        log.info("trainer pids cgroup %s (at most %d tasks)", folder, max_pids)
        return True

    def _file(self, name: str) -> Path:
        return self.path / name

    def _configure(self) -> None:
        """v2: an OOM kills the whole group, and no swap; v1: the OOM killer is on."""
        if self.version == 2:
            for name, value in (("memory.oom.group", 1), ("memory.swap.max", 0)):
                if self._file(name).exists():  # oom.group: 4.19+; swap.max: swap accounted
                    _write(self._file(name), value)  # oom.group: one rank dead hangs DDP
        else:
            with contextlib.suppress(OSError):
                _write(self._file("memory.oom_control"), 0)

    def set_limit(self, limit_bytes: int) -> None:
        """The memory limit (v1: memory and memory+swap alike, where swap is accounted).
        OSError where the kernel refuses it."""
        if self.version == 2:
            _write(self._file("memory.max"), limit_bytes)
        else:
            _set_v1_limit(self.path, limit_bytes)
        self.limit_bytes = limit_bytes

    def enter_fn(self) -> Callable[[], None]:
        """A function for Popen's `preexec_fn`: moves the child into this cgroup before it
        execs (only os.open, os.write and os.close: safe after a fork of a threaded
        process). Raises OSError where it cannot, which fails the Popen: a trainer never
        runs outside its cgroup."""
        files = [os.fsencode(f / "cgroup.procs") for f in (self.path, *self.extra)]

        def enter() -> None:
            for procs in files:
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, b"%d" % os.getpid())  # "0" is not this process for v1
                finally:
                    os.close(fd)

        return enter

    def add(self, pid: int) -> None:
        """Move a running process (and from then on its new children) in; OSError if not."""
        for folder in (self.path, *self.extra):
            _write(folder / "cgroup.procs", pid)

    def pids(self) -> list[int]:
        """The processes in it now."""
        return _pids(self.path)

    def oom_kills(self) -> int | None:
        """How many processes in this cgroup the kernel's OOM killer has killed since it was
        made (its own counter: v2 `memory.events`, v1 `memory.oom_control`, Linux 4.13+),
        None where it cannot be read. Compare a count from before a trainer starts."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(self._file(name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value) if value.strip().isdigit() else None
        return None

    def peak_bytes(self) -> int | None:
        """The most memory it has held (v2 `memory.peak`, Linux 5.19+; v1 since `reset`)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        text = _read(self._file(name)).strip()
        return int(text) if text.isdigit() else None

    def reset(self) -> None:
        """Between jobs: v1's high-water marks back to zero (v2 has none to reset; the OOM
        counter is never reset, compare counts instead)."""
        if self.version == 1:
            for name in ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes",
                         "memory.failcnt"):  # fmt: skip
                with contextlib.suppress(OSError):
                    _write(self._file(name), 0)

    def kill_all(self, spare_groups: Collection[int] = ()) -> int:
        """SIGKILL every process in it (what escaped the trainer's process group, too) but
        those of the process groups `spare_groups` (an idle standby's): v2's `cgroup.kill`
        where there is one (5.14+) and nothing is spared, else each pid, a few rounds for
        forks that race the kill. How many were signalled (v2 `cgroup.kill`: 0)."""
        if not spare_groups and self.version == 2 and self._file("cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self._file("cgroup.kill"), 1)
                return 0
        killed: set[int] = set()
        for _ in range(KILL_ROUNDS):
            pids = [p for p in self.pids() if _group_of(p) not in spare_groups]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        return len(killed)

    def close(self, timeout_s: float = 5.0) -> bool:
        """At the worker's exit: kill what is left in it, wait for it to empty, remove it.
        False, logged, if it could not be removed."""
        self.kill_all()
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.remove()

    def remove(self) -> bool:
        """At the worker's exit: remove the cgroup (it must be empty: `kill_all` and reap
        first). False, logged, if it could not be."""
        ok = True
        for folder in (self.path, *self.extra):
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("could not remove the trainer cgroup %s (%s)", folder, e)
                ok = False
        return ok


def _set_v1_limit(path: Path, limit: int) -> None:
    """v1 wants memory+swap >= memory at every step: lowering sets memory first, raising
    memory+swap first. Memory+swap is set where it is accounted and writable."""
    memory, memsw = path / "memory.limit_in_bytes", path / "memory.memsw.limit_in_bytes"
    try:
        _write(memory, limit)
    except OSError as e:
        if e.errno != errno.EINVAL or not memsw.exists():
            raise
        _write(memsw, limit)
        _write(memory, limit)
        return
    if memsw.exists():
        try:
            _write(memsw, limit)
        except OSError as e:
            log.info("memory+swap limit of %s not set (%s): swap is not limited", path, e)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:  # gone already
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(hierarchy: MemoryHierarchy | None = None) -> list[Path]:
    """At the worker's start: remove the empty trainer cgroups (`torchyard-<pid>-…`) that
    workers now dead left beside ours. One that still holds processes is kept, and logged.
    The cgroups removed."""
    if hierarchy is None:  # the memory hierarchy, and v1's pids one beside it
        pids = find_cgroup("pids")
        extra = sweep_stale(pids) if pids is not None and pids.version == 1 else []
        memory = find_memory_cgroup()
        return (sweep_stale(memory) if memory is not None else []) + extra
    h = hierarchy
    removed, me = [], os.getpid()
    with contextlib.suppress(OSError):
        for entry in sorted(trainer_base(h).iterdir()):
            m = OURS.fullmatch(entry.name)
            if m is None or not entry.is_dir() or int(m.group(1)) == me or _alive(int(m.group(1))):
                continue
            if _pids(entry):
                log.warning("stale trainer cgroup %s still holds processes; kept", entry)
                continue
            try:
                entry.rmdir()
            except OSError as e:
                log.warning("could not remove stale trainer cgroup %s (%s)", entry, e)
                continue
            removed.append(entry)
    return removed
