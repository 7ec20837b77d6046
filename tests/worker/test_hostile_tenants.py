"""Tenants apart on one host (issue 42, finding 6): what one user's job could do to another's
on a shared worker host. The seccomp filter (worker/seccomp.py) is checked twice: its
program on a small classic-BPF interpreter (both ABIs, every branch), and inside a real
sandbox, where the calls a job used against other tenants fail with EPERM."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from support.backends import only
from test_zygote import _bundle, _request, _script, slot  # noqa: F401 (slot: its fixture)

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import User
from torchyard.store.sandboxuids import sandbox_uid
from torchyard.worker import seccomp
from torchyard.worker.cgroups import TrainerCgroup
from torchyard.worker.launch_local import trainer_cgroup
from torchyard.worker.launch_sandbox import SandboxLauncher
from torchyard.worker.sandbox import Mounts, identity, sandbox_argv, sandbox_env, support
from torchyard.worker.zygote import ZygoteTrainer, children

needs_bwrap = pytest.mark.skipif(
    not support().ok and os.environ.get("CI") != "true", reason=f"no sandbox: {support().why}"
)

# ---- the program, run on an interpreter of the instructions it uses ------------------------


def run_filter(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the kernel would return for this call: classic BPF, the opcodes seccomp.py
    emits (ld word absolute, jeq / jge / jset with a constant, ret a constant)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    ins = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        pc += 1
        if code == seccomp.BPF_LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == seccomp.BPF_RET_K:
            return k
        else:
            test = {
                seccomp.BPF_JEQ_K: acc == k,
                seccomp.BPF_JGE_K: acc >= k,
                seccomp.BPF_JSET_K: bool(acc & k),
            }[code]
            pc += jt if test else jf


EPERM = seccomp.RET_ERRNO | seccomp.EPERM
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17


@pytest.mark.parametrize("arch", [seccomp.X86_64, seccomp.AARCH64], ids=lambda a: a.name)
def test_the_filter_refuses_what_it_lists_and_allows_the_rest(arch: seccomp.Arch) -> None:
    prog, nums = seccomp.program(arch), arch.numbers
    assert len(prog) // 8 < 4096  # the kernel's limit on a program's length

    def verdict(name: str | int, arg0: int = 0, audit: int = arch.audit) -> int:
        nr = nums[name] if isinstance(name, str) else name
        return run_filter(prog, nr, audit, arg0)

    for name in ("keyctl", "add_key", "request_key", "unshare", "bpf", "perf_event_open",
                 "userfaultfd", "mount", "ptrace", "setns", "kexec_load", "open_by_handle_at"):  # fmt: skip
        assert verdict(name) == EPERM, name
    assert set(seccomp.denied(arch)) == set(nums) - set(seccomp.APART)
    assert verdict("clone", CLONE_NEWUSER | SIGCHLD) == EPERM
    assert verdict("clone", 0x01200000 | SIGCHLD) == seccomp.RET_ALLOW  # fork (glibc's flags)
    assert verdict("clone", 0x003D0F00) == seccomp.RET_ALLOW  # a thread (glibc's flags)
    assert verdict("clone3") == seccomp.RET_ERRNO | seccomp.ENOSYS  # glibc falls back to clone
    assert verdict("personality", 0x0040000) == EPERM  # ADDR_NO_RANDOMIZE
    for value in seccomp.PERSONALITY_OK:
        assert verdict("personality", value) == seccomp.RET_ALLOW
    for allowed in (0, 1, 57, 60, 231, 425 - 1):  # read, write, fork, exit, exit_group, …
        if allowed not in nums.values():
            assert verdict(allowed) == seccomp.RET_ALLOW, allowed
    foreign = 0x40000003 if arch is seccomp.X86_64 else 0x40000028  # i386, arm
    assert verdict(nums["keyctl"], audit=foreign) == seccomp.RET_KILL_PROCESS
    assert verdict(0, audit=foreign) == seccomp.RET_KILL_PROCESS  # any call of another ABI
    if arch.x32:
        assert verdict(seccomp.X32_BIT | 250) == seccomp.RET_KILL_PROCESS  # x32's keyctl


# ---- inside a real sandbox -----------------------------------------------------------------

ATTACKS = r"""
import ctypes, json, os, subprocess, sys, threading
nums = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nums[name]), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())

out["keyctl"] = call("keyctl", 0, -3, 1)  # KEYCTL_GET_KEYRING_ID, the session keyring
key = ctypes.c_char_p
ctypes.set_errno(0)
r = libc.syscall(ctypes.c_long(nums["add_key"]), key(b"user"), key(b"mine"), key(b"secret"),
                 ctypes.c_size_t(6), ctypes.c_long(-2))  # the process keyring
out["add_key"] = "ok" if r >= 0 else os.strerror(ctypes.get_errno())
out["bpf"] = call("bpf", 0, 0, 0)
out["perf_event_open"] = call("perf_event_open", 0, 0, -1, -1, 0)
pid = libc.syscall(ctypes.c_long(nums["clone"]), ctypes.c_long(0x10000000 | 17), 0, 0, 0, 0)
if pid == 0:
    os._exit(0)  # the child, in a user namespace of its own: gone at once
out["clone_newuser"] = "ok" if pid > 0 else os.strerror(ctypes.get_errno())
if pid > 0:
    os.waitpid(pid, 0)
r = subprocess.run(["unshare", "-Ur", "true"], capture_output=True, text=True)
out["unshare_Ur"] = "ok" if r.returncode == 0 else r.stderr.strip()
# What a trainer does keeps working: threads (clone3 refused, clone used), fork.
t = threading.Thread(target=lambda: None)
t.start()
t.join()
child = os.fork()
if child == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
print(json.dumps(out))
"""


def _in_sandbox(tmp_path: Path, script: str, *args: str,
                cgroup: TrainerCgroup | None = None) -> dict[str, object]:  # fmt: skip
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    ident = identity(64000)
    if (owner := ident.owns()) is not None:
        os.chown(run, *owner)
    env = sandbox_env(dict(os.environ), os.path.dirname(sys.executable))
    with seccomp.filter_fd() as fd:
        argv = sandbox_argv([sys.executable, "-c", script, *args], Mounts(run), ident, fd)
        fds = () if fd is None else (fd,)
        enter = cgroup.enter_fn() if cgroup is not None else None
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                           pass_fds=fds, preexec_fn=enter)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.splitlines()[-1]))


@needs_bwrap
@pytest.mark.hostile
def test_keyrings_namespaces_bpf_and_perf_are_refused_inside(tmp_path: Path) -> None:
    arch = seccomp.host_arch()
    assert arch is not None, "no syscall table for this host's ABI"
    out = _in_sandbox(tmp_path, ATTACKS, json.dumps(arch.numbers))
    eperm = os.strerror(1)
    for name in ("keyctl", "add_key", "bpf", "perf_event_open", "clone_newuser"):
        assert out[name] == eperm, (name, out)
    assert "Operation not permitted" in str(out["unshare_Ur"]), out
    assert out["fork"] == 7  # threads and fork still work (the trainer's loader workers)


FORK_BOMB = r"""
import json, os, signal
kids, err = [], None
for _ in range(2000):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.kill(k, signal.SIGKILL)
    os.waitpid(k, 0)
print(json.dumps({"forked": len(kids), "errno": err}))
"""


@needs_bwrap
@pytest.mark.hostile
def test_a_fork_bomb_stops_at_the_trainer_cgroups_pids_limit(tmp_path: Path) -> None:
    """2,000 forks in a sandboxed job: the slot's trainer cgroup (made as the launcher makes
    it, from TORCHYARD_TRAINER_MAX_PIDS) stops them at its limit with EAGAIN; the worker
    (this process) forks on, and nothing of the job is left in the cgroup."""
    cg = trainer_cgroup(Settings(home=tmp_path / "home", trainer_max_pids=64))
    if cg is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: this host must have a writable memory cgroup")
        pytest.skip("no writable memory cgroup on this host")
    out = _in_sandbox(tmp_path, FORK_BOMB, cgroup=cg)
    assert out["errno"] == errno.EAGAIN and int(str(out["forked"])) < 64, out
    assert subprocess.run(["true"]).returncode == 0
    deadline = time.monotonic() + 5  # the sandbox's init dies with bwrap, a moment later
    while cg.pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cg.pids() == []


STOP_THE_ZYGOTE = """
import os, signal
os.kill(os.getppid(), signal.SIGSTOP)  # permitted (the same uid); then the job exits 0
"""


@needs_bwrap
@pytest.mark.hostile
def test_a_job_that_stops_its_zygote_ends_and_the_slot_gets_a_new_one(
    slot: Any,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """The stopped zygote never reaps its job nor reports it: the job stayed `running` until
    cancelled. The worker sees the job's pidfd readable and the zygote stopped, and ends the
    sandbox; the slot's next warm trainer is a new one."""
    settings, warm, launcher = slot
    code = _bundle(tmp_path, {"stop.py": STOP_THE_ZYGOTE})
    run = settings.storage / "jobs" / "a"
    trainer = launcher.start(_request(settings, run, _script("stop.py"), code))
    assert isinstance(trainer, ZygoteTrainer)
    assert trainer.wait(30) == -signal.SIGKILL, (run / "output.log").read_text()
    assert trainer.zygote.proc.poll() is not None  # the sandbox is gone
    warm.refill()
    assert warm.proc is not None and warm.proc is not trainer.zygote.proc


HOLD_A_SECRET = r"""
import os, sys, time
fd = os.open("/job/secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"user A's")
os.close(fd)
print("READY", flush=True)
time.sleep(60)
"""

AS_USER_B = r"""
import json, os, sys
pid, secret = int(sys.argv[1]), sys.argv[2]
out = {}
try:
    os.kill(pid, 0)
    out["signal"] = "sent"
except OSError as e:
    out["signal"] = type(e).__name__
for name, path in (("secret", secret), ("environ", f"/proc/{pid}/environ")):
    try:
        open(path, "rb").read(1)
        out[name] = "read"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise LookupError(pid)


def _descendant_as(pid: int, uid: int) -> int:
    """The process under `pid` (bwrap) that runs as `uid`: the sandbox's trainer."""
    todo = [pid]
    while todo:
        p = todo.pop()
        if p != pid and _uid_of(p) == uid:
            return p
        todo += children(p)
    raise LookupError(f"no process of uid {uid} under {pid}")


@pytest.mark.skipif(os.geteuid() != 0, reason="per-user uids are a root worker's")
@needs_bwrap
@pytest.mark.hostile
@only("postgres")
def test_user_bs_uid_cannot_signal_or_read_user_as_trainer(db_url: str, tmp_path: Path) -> None:
    """Two users' jobs at once on one host: each runs as its user's own uid (given by the
    store), so what B's code could reach outside its namespaces as its uid (a signal to A's
    trainer, A's private file, A's /proc) is refused by the kernel. Every trainer shared
    uid 64000 before, and all three worked."""
    settings = Settings(home=tmp_path / "home", database_url=db_url)
    with session_scope(db_url) as s:
        users = [User(name="a"), User(name="b")]
        s.add_all(users)
        s.flush()
        ids = [u.id for u in users]
    uid_a, uid_b = (sandbox_uid(settings, i) for i in ids)
    assert uid_a is not None and uid_b is not None and uid_a != uid_b
    assert settings.sandbox_uid not in (uid_a, uid_b)
    run = Path(tempfile.mkdtemp(prefix="ty-tenant-a-"))  # B could reach it but for its owner
    os.chmod(run, 0o755)
    os.chown(run, uid_a, uid_a)
    argv = sandbox_argv([sys.executable, "-c", HOLD_A_SECRET], Mounts(run), identity(uid_a))
    env = sandbox_env(dict(os.environ), os.path.dirname(sys.executable))
    a = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == "READY"
        trainer = _descendant_as(a.pid, uid_a)
        b = ["setpriv", f"--reuid={uid_b}", f"--regid={uid_b}", "--clear-groups", "--"]
        probe = [*b, sys.executable, "-c", AS_USER_B, str(trainer), str(run / "secret")]
        r = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"signal": "PermissionError", "secret": "PermissionError",
                       "environ": "PermissionError"}, out  # fmt: skip
    finally:
        a.kill()
        a.wait()
        shutil.rmtree(run, ignore_errors=True)


LISTEN = r"""
import socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0torchyard-tenant-a")  # an abstract name: no file, no permission check
s.listen(1)
print("READY", flush=True)
time.sleep(60)
"""

CONNECT = r"""
import json, socket
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    c.connect("\0torchyard-tenant-a")
    print(json.dumps("connected"))
except OSError as e:
    print(json.dumps(type(e).__name__))
"""


@needs_bwrap
@pytest.mark.hostile
def test_with_sandbox_network_none_abstract_sockets_do_not_join_two_jobs(
    tmp_path: Path,
) -> None:
    """Abstract Unix sockets belong to a network namespace: on the host's, one user's job
    connected to another's. TORCHYARD_SANDBOX_NETWORK=none gives each one-rank trainer a
    namespace of its own (DDP ranks keep the host's: they rendezvous over it)."""
    launcher = SandboxLauncher(Settings(home=tmp_path / "home", sandbox_network="none"), None)
    own = launcher._host_network(1)
    assert own is False and launcher._host_network(2) is True
    env = sandbox_env(dict(os.environ), os.path.dirname(sys.executable))
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
    ident = identity(64000)
    argv = sandbox_argv([sys.executable, "-c", LISTEN], Mounts(runs[0], host_network=own), ident)
    a = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == "READY"
        argv = sandbox_argv(
            [sys.executable, "-c", CONNECT], Mounts(runs[1], host_network=own), ident
        )
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == "ConnectionRefusedError"
    finally:
        a.kill()
        a.wait()
