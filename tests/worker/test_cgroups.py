"""worker/cgroups.py: each trainer in a memory cgroup of its own. Discovery on fake /proc
files (v1, v2, hybrid, a container's mount that shows its own cgroup at the top); the
kernel's side on this host's real memory cgroup: a trainer over its limit is SIGKILLed alone
and counted in its own cgroup's OOM counter, never another's. The real-kernel tests skip
where the host has no memory cgroup we may write to, except under CI=true (they must run)."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchyard.worker import cgroups
from torchyard.worker.cgroups import MemoryHierarchy, TrainerCgroup

MIB = 1024**2
_seq = itertools.count()
MakeCgroup = Callable[..., TrainerCgroup]

# ---- discovery on fake /proc files ---------------------------------------------------------


def _mountinfo(*lines: str) -> str:
    base = "22 1 0:20 / /sys rw,nosuid - sysfs sysfs rw"
    return "\n".join([base, *lines]) + "\n"


def _v1_line(root: str, point: Path) -> str:
    return f"35 31 0:32 {root} {point} rw,relatime - cgroup cgroup rw,memory"


def _v2_line(root: str, point: Path) -> str:
    return f"41 31 0:38 {root} {point} rw,relatime - cgroup2 cgroup2 rw"


def _cgroup_dir(path: Path, pids: list[int], controllers: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (path / "cgroup.controllers").write_text(controllers)
    return path


def _proc(tmp: Path, cgroup: str, mountinfo: str) -> dict[str, Path]:
    (tmp / "cgroup").write_text(cgroup)
    (tmp / "mountinfo").write_text(mountinfo)
    return {"proc_cgroup": tmp / "cgroup", "mountinfo": tmp / "mountinfo"}


V1_LINES = "5:devices:/\n4:memory:{path}\n3:cpu,cpuacct:/\n0::/\n"


def test_v1_path_under_the_mount(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    own = _cgroup_dir(mount / "process_api" / "abc", [4242])
    _cgroup_dir(mount, [1, 2])
    files = _proc(
        tmp_path, V1_LINES.format(path="/process_api/abc"), _mountinfo(_v1_line("/", mount))
    )
    assert cgroups.find_memory_cgroup(**files, pid=4242) == MemoryHierarchy(1, own, mount)


def test_v1_container_mount_shows_its_own_cgroup_at_the_top(tmp_path: Path) -> None:
    """docker (v1, no cgroup namespace): /proc/self/cgroup says /docker/<id>, which does not
    exist under the mount: the mount's root field is /docker/<id>, its top is our cgroup."""
    mount = _cgroup_dir(tmp_path / "memory", [7])
    files = _proc(
        tmp_path,
        V1_LINES.format(path="/docker/f00"),
        _mountinfo(_v1_line("/docker/f00", mount)),
    )
    assert cgroups.find_memory_cgroup(**files, pid=7) == MemoryHierarchy(1, mount, mount)
    child = _cgroup_dir(mount / "sub", [8])  # a deeper path, relative to the mount's root
    files = _proc(
        tmp_path,
        V1_LINES.format(path="/docker/f00/sub"),
        _mountinfo(_v1_line("/docker/f00", mount)),
    )
    assert cgroups.find_memory_cgroup(**files, pid=8) == MemoryHierarchy(1, child, mount)


def test_v1_root_field_slash_but_path_missing_falls_back_to_the_top(tmp_path: Path) -> None:
    mount = _cgroup_dir(tmp_path / "memory", [9])
    files = _proc(tmp_path, V1_LINES.format(path="/lxc/x"), _mountinfo(_v1_line("/", mount)))
    assert cgroups.find_memory_cgroup(**files, pid=9) == MemoryHierarchy(1, mount, mount)


def test_v2_unified(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    _cgroup_dir(mount, [1], "cpu memory pids")
    own = _cgroup_dir(mount / "system.slice" / "ty.service", [55], "cpu memory pids")
    files = _proc(tmp_path, "0::/system.slice/ty.service\n", _mountinfo(_v2_line("/", mount)))
    assert cgroups.find_memory_cgroup(**files, pid=55) == MemoryHierarchy(2, own, mount)


def test_v2_escaped_mount_point(tmp_path: Path) -> None:
    mount = _cgroup_dir(tmp_path / "c g", [5], "memory")
    escaped = str(mount).replace(" ", "\\040")
    files = _proc(tmp_path, "0::/\n", _mountinfo(f"41 31 0:38 / {escaped} rw - cgroup2 none rw"))
    assert cgroups.find_memory_cgroup(**files, pid=5) == MemoryHierarchy(2, mount, mount)


def test_hybrid_takes_v1_memory_and_v2_without_memory_is_none(tmp_path: Path) -> None:
    v1 = _cgroup_dir(tmp_path / "memory", [3])
    unified = _cgroup_dir(tmp_path / "unified", [3], "")  # hybrid: no controller on v2
    info = _mountinfo(_v1_line("/", v1), _v2_line("/", unified))
    files = _proc(tmp_path, V1_LINES.format(path="/"), info)
    assert cgroups.find_memory_cgroup(**files, pid=3) == MemoryHierarchy(1, v1, v1)
    files = _proc(tmp_path, "0::/\n", info)
    assert cgroups.find_memory_cgroup(**files, pid=3) is None


def test_not_ours_or_nothing_is_none(tmp_path: Path) -> None:
    mount = _cgroup_dir(tmp_path / "memory", [1])
    files = _proc(tmp_path, V1_LINES.format(path="/"), _mountinfo(_v1_line("/", mount)))
    assert cgroups.find_memory_cgroup(**files, pid=2) is None  # not listed: not our cgroup
    files = _proc(tmp_path, "0::/../../elsewhere\n", _mountinfo(_v2_line("/", mount)))
    assert cgroups.find_memory_cgroup(**files, pid=1) is None
    missing = tmp_path / "none"
    assert cgroups.find_memory_cgroup(missing, missing, pid=1) is None


def test_default_limit_is_90_percent_of_the_tightest_share(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    own = _cgroup_dir(mount / "a" / "b", [1])
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (mount / "a" / "memory.limit_in_bytes").write_text(f"{1000 * MIB}\n")
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096000 kB\nMemFree: 1 kB\n")
    h = MemoryHierarchy(1, own, mount)
    assert cgroups.worker_limit(h) == 1000 * MIB
    assert cgroups.default_limit(h, meminfo) == int(1000 * MIB * 0.9)
    (mount / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroups.default_limit(h, meminfo) == int(4096000 * 1024 * 0.9)
    v2 = MemoryHierarchy(2, _cgroup_dir(tmp_path / "v2", [1]), tmp_path / "v2")
    (v2.path / "memory.max").write_text("max\n")
    assert cgroups.default_limit(v2, meminfo) == int(4096000 * 1024 * 0.9)


def test_v2_create_sets_limit_group_kill_and_no_swap(tmp_path: Path) -> None:
    """On fake files (this host's memory controller is v1): what create writes for v2."""
    base = _cgroup_dir(tmp_path / "cg", [os.getpid()], "memory")
    (base / "cgroup.subtree_control").write_text("")
    child = _cgroup_dir(base / "torchyard-1-gpu0", [])
    for name in ("memory.max", "memory.oom.group", "memory.swap.max"):
        (child / name).write_text("")
    (child / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    cg = TrainerCgroup.create("torchyard-1-gpu0", 256 * MIB, MemoryHierarchy(2, base, base))
    assert cg is not None
    assert (child / "memory.max").read_text() == str(256 * MIB)
    assert (child / "memory.oom.group").read_text() == "1"
    assert (child / "memory.swap.max").read_text() == "0"
    assert (base / "cgroup.subtree_control").read_text() == "+memory"
    assert cg.oom_kills() == 2


def test_v2_pids_limit_lies_in_the_trainers_own_cgroup(tmp_path: Path) -> None:
    """On fake files: v2 limits tasks in the trainer's memory cgroup itself (pids handed
    down to it); v1 in a folder of the same name in the pids hierarchy, entered too."""
    base = _cgroup_dir(tmp_path / "cg", [os.getpid()], "memory pids")
    (base / "cgroup.subtree_control").write_text("memory")
    child = _cgroup_dir(base / "torchyard-1-gpu0", [])
    (child / "pids.max").write_text("max")
    cg = TrainerCgroup(child, 2, 64 * MIB)
    assert cg.limit_pids(child.name, 100, MemoryHierarchy(2, base, base))
    assert (child / "pids.max").read_text() == "100" and cg.extra == []
    assert (base / "cgroup.subtree_control").read_text() == "+pids"
    pids = _cgroup_dir(tmp_path / "pids", [os.getpid()])
    (pids / "torchyard-1-gpu0").mkdir()
    (pids / "torchyard-1-gpu0" / "pids.max").write_text("max")
    assert cg.limit_pids(child.name, 50, MemoryHierarchy(1, pids, pids))
    assert (pids / "torchyard-1-gpu0" / "pids.max").read_text() == "50"
    assert cg.extra == [pids / "torchyard-1-gpu0"] and cg.max_pids == 50


def test_v2_busy_parent_moves_the_worker_into_its_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The no-internal-processes rule: the worker alone in its cgroup moves into a leaf of
    its own; a cgroup shared with other processes is not taken over (create: None)."""
    base = _cgroup_dir(tmp_path / "cg", [os.getpid()], "memory")
    control = base / "cgroup.subtree_control"
    control.write_text("")
    real_write, busy = cgroups._write, [True]

    def write(path: Path, value: str | int) -> None:
        if path == control and busy[0]:
            busy[0] = False
            raise OSError(errno.EBUSY, "busy")
        real_write(path, value)

    monkeypatch.setattr(cgroups, "_write", write)
    leaf = _cgroup_dir(base / f"torchyard-{os.getpid()}-worker", [])  # the kernel's files
    cgroups._delegate_memory(base, os.getpid())
    assert (leaf / "cgroup.procs").read_text() == str(os.getpid())
    assert control.read_text() == "+memory"
    assert cgroups.trainer_base(MemoryHierarchy(2, leaf, base)) == base
    busy[0] = True
    (base / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")
    with pytest.raises(OSError, match="other processes"):
        cgroups._delegate_memory(base, os.getpid())


def test_no_cgroup_is_none_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cgroups, "find_memory_cgroup", lambda: None)
    with caplog.at_level(logging.WARNING, logger=cgroups.__name__):
        assert TrainerCgroup.create("torchyard-1-x", 64 * MIB) is None
    assert "no memory cgroup" in caplog.text
    gone = MemoryHierarchy(1, tmp_path / "missing", tmp_path)
    assert TrainerCgroup.create("torchyard-1-x", 64 * MIB, gone) is None  # mkdir fails
    assert "cannot make" in caplog.text


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".", "torchyard-1-worker", "x" * 101])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="cgroup name"):
        TrainerCgroup.create(name, 64 * MIB)


# ---- this host's kernel --------------------------------------------------------------------


def _real(limit: int) -> TrainerCgroup:
    cg = TrainerCgroup.create(cgroups.slot_name(f"test{next(_seq)}"), limit)
    if cg is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: this host must have a writable memory cgroup")
        pytest.skip("no writable memory cgroup on this host")
    return cg


@pytest.fixture
def make_cgroup() -> Iterator[MakeCgroup]:
    made: list[TrainerCgroup] = []

    def make(limit: int = 64 * MIB) -> TrainerCgroup:
        made.append(_real(limit))
        return made[-1]

    yield make
    for cg in made:
        assert cg.close()


def _python(code: str, cg: TrainerCgroup, **kw: object) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-I", "-S", "-c", code]
    return subprocess.Popen(argv, preexec_fn=cg.enter_fn(), **kw)  # type: ignore[call-overload]


ALLOCATE = "b = []\nfor _ in range({n}): b.append(b'x' * (16 << 20))\n"  # touched pages


@pytest.mark.hostile
def test_over_its_limit_the_trainer_alone_is_killed_and_counted(make_cgroup: MakeCgroup) -> None:
    """256 MiB in a 64 MiB cgroup: SIGKILL by the kernel, counted in the cgroup's own
    counter; the worker (this process, in the parent cgroup) goes on."""
    cg = make_cgroup(64 * MIB)
    before = cg.oom_kills()
    assert before is not None
    proc = _python(ALLOCATE.format(n=16), cg)
    assert proc.wait(30) == -9
    after = cg.oom_kills()
    assert after is not None and after >= before + 1
    assert cg.peak_bytes() is not None and cg.peak_bytes() <= 64 * MIB


def test_under_its_limit_the_trainer_runs(make_cgroup: MakeCgroup) -> None:
    cg = make_cgroup(64 * MIB)
    before = cg.oom_kills()
    proc = _python(ALLOCATE.format(n=1) + "print('ok')", cg, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == b"ok"
    assert cg.oom_kills() == before


@pytest.mark.hostile
def test_another_cgroups_oom_is_not_taken_for_this_trainers(make_cgroup: MakeCgroup) -> None:
    """The host-wide count rose for any OOM kill on the host: another slot's trainer dying of
    OOM was taken for this one's. Each cgroup's own counter tells them apart."""
    mine, theirs = make_cgroup(64 * MIB), make_cgroup(64 * MIB)
    running = _python("import time; time.sleep(30)", mine)
    mine_before, theirs_before = mine.oom_kills(), theirs.oom_kills()
    assert _python(ALLOCATE.format(n=16), theirs).wait(30) == -9
    assert theirs.oom_kills() > theirs_before  # type: ignore[operator]
    assert mine.oom_kills() == mine_before
    assert running.poll() is None  # the other slot's trainer was not touched
    running.kill()
    running.wait()


def test_the_child_and_its_children_are_in_the_cgroup(make_cgroup: MakeCgroup) -> None:
    cg = make_cgroup()
    code = (
        "import subprocess, sys\n"
        "print(open('/proc/self/cgroup').read())\n"
        "print(subprocess.run(['cat', '/proc/self/cgroup'], capture_output=True, text=True).stdout)"
    )
    out = _python(code, cg, stdout=subprocess.PIPE).communicate(timeout=30)[0].decode()
    assert out.count(cg.path.name) == 2


def test_enter_fails_closed(make_cgroup: MakeCgroup) -> None:
    """A cgroup that cannot be entered fails the start: a trainer never runs outside it."""
    cg = make_cgroup()
    enter = cg.enter_fn()
    assert cg.remove()
    with pytest.raises(subprocess.SubprocessError):
        subprocess.Popen(["true"], preexec_fn=enter)


@pytest.mark.hostile
def test_kill_all_ends_what_left_the_process_group(make_cgroup: MakeCgroup) -> None:
    """A trainer that daemonised a child in a new session escapes its group's SIGKILL, not
    its cgroup."""
    cg = make_cgroup()
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True, stdout=subprocess.DEVNULL)\n"
        "print(p.pid)"
    )
    out = _python(code, cg, stdout=subprocess.PIPE).communicate(timeout=30)[0]
    escaped = int(out)
    assert escaped in cg.pids()
    assert cg.close()  # killed and removed
    assert not cg.path.exists()
    assert _gone_or_zombie(escaped)


def _gone_or_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # dead, its parent not told yet


def test_limit_raised_and_lowered(make_cgroup: MakeCgroup) -> None:
    """v1 wants memory+swap >= memory at every step; either order of change works."""
    cg = make_cgroup(64 * MIB)
    name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
    for limit in (256 * MIB, 32 * MIB, 128 * MIB):
        cg.set_limit(limit)
        assert int((cg.path / name).read_text()) == limit
        swap = cg.path / "memory.memsw.limit_in_bytes"
        if cg.version == 1 and swap.exists():
            assert int(swap.read_text()) == limit
    cg.reset()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_dead_workers_empty_cgroups(make_cgroup: MakeCgroup) -> None:
    mine = make_cgroup()
    base = mine.path.parent
    dead = _dead_pid()
    stale = base / f"torchyard-{dead}-gpu0"
    busy = base / f"torchyard-{dead}-gpu1"
    alive = base / "torchyard-1-gpu0"  # pid 1 lives
    for d in (stale, busy, alive):
        d.mkdir()
    held = TrainerCgroup(busy, mine.version, 64 * MIB)
    sleeper = _python("import time; time.sleep(30)", held)
    try:
        deadline = time.monotonic() + 5
        while not held.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        h = MemoryHierarchy(mine.version, base, base)
        assert stale in cgroups.sweep_stale(h)
        assert not stale.exists() and busy.exists() and alive.exists() and mine.path.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in (busy, alive):
            deadline = time.monotonic() + 5
            while d.exists() and time.monotonic() < deadline:
                try:
                    d.rmdir()
                except OSError:
                    time.sleep(0.01)


def test_kill_all_spares_the_idle_standbys_group(make_cgroup: MakeCgroup) -> None:
    """Between jobs: a straggler of the last job dies, the slot's idle standby (its own
    process group) lives on."""
    cg = make_cgroup()
    standby = subprocess.Popen(["sleep", "30"], preexec_fn=cg.enter_fn(), start_new_session=True)
    straggler = subprocess.Popen(["sleep", "30"], preexec_fn=cg.enter_fn(), start_new_session=True)
    try:
        assert cg.kill_all(spare_groups=(standby.pid,)) == 1
        assert straggler.wait(5) == -9
        assert standby.poll() is None
    finally:
        standby.kill()
        standby.wait()
