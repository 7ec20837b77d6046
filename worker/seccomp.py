"""The trainer's seccomp filter: a classic-BPF program, assembled here in pure Python, that
bubblewrap loads (`--seccomp FD`) just before it runs the trainer (cold, or the slot's
zygote and so every job it forks). Modelled on the default profile of Docker and Podman
(the syscalls they allow only with a capability a trainer never has, plus the ones they
deny outright), written as a deny list: what a trainer needs keeps working, and the kernel
surface a tenant could use against the host or another tenant is refused.

The program first checks `seccomp_data.arch`: a foreign ABI (i386's `int 0x80` on x86_64,
arm32 on aarch64) kills the process (its syscall numbers are another table, which this
filter does not check), and so does x86_64's x32 ABI (numbers with bit 30 set). Then:

| syscall | why denied (EPERM unless said) |
|---|---|
| keyctl, add_key, request_key | the kernel keyring is per uid, not per namespace: one job read a key another left |
| unshare, setns | new namespaces (`unshare -Ur` gave a job a user namespace with every capability in it) |
| clone with a CLONE_NEW* flag | the same through clone (the flags argument is checked; plain fork and threads pass) |
| clone3 (ENOSYS) | its flags lie in a struct a filter cannot read; ENOSYS makes glibc fall back to clone |
| bpf | eBPF programs and maps: kernel attack surface |
| perf_event_open | profiling other processes, side channels, kernel attack surface |
| userfaultfd | pauses the kernel mid-copy: the usual helper of kernel exploits |
| io_uring_setup, io_uring_enter, io_uring_register | a second syscall path that bypasses this filter's view; kernel attack surface (Docker denies it too) |
| mount, umount2, pivot_root, move_mount, open_tree, fsopen, fsconfig, fsmount, fspick, mount_setattr | the sandbox's mounts are its walls |
| ptrace, process_vm_readv, process_vm_writev, kcmp, pidfd_getfd | another process's memory or descriptors; the trainer needs none |
| kexec_load, kexec_file_load, init_module, finit_module, delete_module, create_module, query_module, get_kernel_syms | the kernel itself |
| acct, swapon, swapoff, reboot, quotactl, quotactl_fd, nfsservctl, vhangup, syslog | host administration |
| settimeofday, clock_settime, clock_adjtime, adjtimex | the host's clock |
| personality (but for the default, PER_LINUX32, UNAME26 and the query) | ASLR off (ADDR_NO_RANDOMIZE), READ_IMPLIES_EXEC |
| lookup_dcookie, open_by_handle_at, name_to_handle_at | open a file by handle, around the sandbox's mounts (the "shocker" escape) |
| iopl, ioperm (x86_64) | I/O ports |
| uselib, ustat, sysfs, _sysctl (x86_64) | obsolete interfaces, kernel attack surface |

Nothing else is refused (Docker's profile is an allow list; its extra refusals are of
syscalls that need a capability the trainer lacks anyway). POSIX message queues are not
refused: the zygote empties them between jobs (trainer/zygote.py).
"""

from __future__ import annotations

import os
import platform
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
BPF_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data (arg0's low word: little-endian)
X32_BIT = 0x40000000
EPERM, ENOSYS = 1, 38

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (Docker's mask)
CLONE_NS_FLAGS = 0x7E020000
# personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26, both, the query.
PERSONALITY_OK = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# The syscalls the filter names: x86_64's number (<asm/unistd_64.h>), aarch64's
# (<asm-generic/unistd.h>); "-" where that ABI has none. Every one but clone, clone3 and
# personality (judged apart, below) is refused outright with EPERM.
NUMBERS = """
keyctl 250 219          add_key 248 217         request_key 249 218
unshare 272 97          setns 308 268           clone 56 220            clone3 435 435
bpf 321 280             perf_event_open 298 241 userfaultfd 323 282
io_uring_setup 425 425  io_uring_enter 426 426  io_uring_register 427 427
mount 165 40            umount2 166 39          pivot_root 155 41       move_mount 429 429
open_tree 428 428       fsopen 430 430          fsconfig 431 431        fsmount 432 432
fspick 433 433          mount_setattr 442 442
ptrace 101 117          process_vm_readv 310 270                        kcmp 312 272
process_vm_writev 311 271                       pidfd_getfd 438 438
kexec_load 246 104      kexec_file_load 320 294 init_module 175 105
finit_module 313 273    delete_module 176 106   create_module 174 -
query_module 178 -      get_kernel_syms 177 -
acct 163 89             swapon 167 224          swapoff 168 225         reboot 169 142
quotactl 179 60         quotactl_fd 443 443     nfsservctl 180 42       vhangup 153 58
syslog 103 116          settimeofday 164 170    clock_settime 227 112
clock_adjtime 305 266   adjtimex 159 171        personality 135 92
lookup_dcookie 212 18   open_by_handle_at 304 265                       iopl 172 -
name_to_handle_at 303 264                       ioperm 173 -            uselib 134 -
ustat 136 -             sysfs 139 -             _sysctl 156 -
"""
APART = ("clone", "clone3", "personality")


@dataclass(frozen=True)
class Arch:
    """One ABI: its AUDIT_ARCH value and its syscall numbers (of those the filter names)."""

    name: str
    audit: int
    numbers: dict[str, int]
    x32: bool = False  # x86_64: numbers with X32_BIT are the x32 ABI's


def _numbers(column: int) -> dict[str, int]:
    words = NUMBERS.split()
    rows = [words[i : i + 3] for i in range(0, len(words), 3)]
    return {row[0]: int(row[column]) for row in rows if row[column] != "-"}


X86_64 = Arch("x86_64", 0xC000003E, _numbers(1), x32=True)
AARCH64 = Arch("aarch64", 0xC00000B7, _numbers(2))
ARCHES = {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}


def denied(arch: Arch) -> list[str]:
    """The syscalls refused outright with EPERM on `arch` (clone, clone3 and personality
    are judged apart)."""
    return [name for name in arch.numbers if name not in APART]


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _ret(value: int) -> bytes:
    return _ins(BPF_RET_K, value)


def program(arch: Arch) -> bytes:
    """The filter for `arch`, as the `struct sock_filter` array bwrap reads. Each test is
    `jeq nr: next, else skip one`, then its return: no jump is farther than one
    instruction, whatever the list's length (classic BPF jumps are 8-bit)."""
    nums = arch.numbers
    out = [_ins(BPF_LD_W_ABS, OFF_ARCH), _ins(BPF_JEQ_K, arch.audit, 1, 0)]
    out += [_ret(RET_KILL_PROCESS), _ins(BPF_LD_W_ABS, OFF_NR)]
    if arch.x32:
        out += [_ins(BPF_JGE_K, X32_BIT, 0, 1), _ret(RET_KILL_PROCESS)]
    for name in denied(arch):
        out += [_ins(BPF_JEQ_K, nums[name], 0, 1), _ret(RET_ERRNO | EPERM)]
    out += [_ins(BPF_JEQ_K, nums["clone3"], 0, 1), _ret(RET_ERRNO | ENOSYS)]
    # clone: refused with a namespace flag in its flags (arg 0), else allowed.
    out += [_ins(BPF_JEQ_K, nums["clone"], 0, 4), _ins(BPF_LD_W_ABS, OFF_ARG0)]
    out += [_ins(BPF_JSET_K, CLONE_NS_FLAGS, 0, 1), _ret(RET_ERRNO | EPERM), _ret(RET_ALLOW)]
    # personality: one of the allowed values (each jumps to the final allow), else refused.
    ok = len(PERSONALITY_OK)
    out += [_ins(BPF_JEQ_K, nums["personality"], 0, ok + 2), _ins(BPF_LD_W_ABS, OFF_ARG0)]
    out += [_ins(BPF_JEQ_K, value, ok - i, 0) for i, value in enumerate(PERSONALITY_OK)]
    out += [_ret(RET_ERRNO | EPERM), _ret(RET_ALLOW)]
    return b"".join(out)


@cache
def host_arch() -> Arch | None:
    """This host's ABI, or None where the filter has no table for it."""
    return ARCHES.get(platform.machine().lower())


@contextmanager
def filter_fd() -> Iterator[int | None]:
    """A descriptor holding this host's program, read from its start (a fresh one per
    sandbox: bwrap reads it to its end), closed on exit; None where there is no table
    for this host's ABI (the sandbox then runs without a filter: `support` says so)."""
    arch = host_arch()
    if arch is None:
        yield None
        return
    fd = os.memfd_create("torchyard-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program(arch))
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)
