"""Every file operation a service (worker, API, scheduler) makes under a folder a job can
write: its run directory, the zygote's `/job`, its private `/code`.

A job runs as another user, but it owns the files and folders it made and can rename or
replace any of them at any instant, with a symbolic link to a file of the host among
others. So a path under such a folder is never handed to `open()`, `shutil` or
`os.replace` by a service running as root: everything here is reached from a folder
opened by descriptor, one part at a time, and no symbolic link is followed at any part
(`openat2` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS where the kernel has it, else each
part opened with O_NOFOLLOW relative to the one before). A file is opened without
blocking (a FIFO would wait forever), checked to be a regular file, and then read,
hashed or copied from that descriptor, never from its path again.

`UnsafePath` for a link or a name that leaves its folder; FileNotFoundError for what is
missing or not a regular file. tests/worker/test_file_rule.py lists every file operation
in `worker/` and fails on one that does not come through here (or is not on its
allow-list with a reason)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from torchyard.storage.keys import UnsafePath, check_key

__all__ = [
    "UnsafePath",
    "append_owned",
    "chown_tree",
    "claim_owned",
    "copy_out",
    "copy_tree",
    "discard",
    "empty_dir",
    "hash_file",
    "link_tree",
    "open_dir",
    "open_file",
    "open_regular_rw",
    "read_file",
    "remove",
    "rename_over",
    "replace_file",
]

BLOCK = 1 << 20
_CLOEXEC = os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
# openat2(2): linux/openat2.h
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]  # fmt: skip


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_works: bool | None = None if _SYS_OPENAT2 else False


def _openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int | None:
    """openat2 beneath `dir_fd` with no link at any part; None where the kernel (or a
    seccomp filter around this process) does not have it."""
    global _openat2_works
    if _openat2_works is False:
        return None
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)  # fmt: skip
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                       ctypes.sizeof(how))  # fmt: skip
    if fd >= 0:
        _openat2_works = True
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:
        _openat2_works = False
        return None
    raise OSError(err, os.strerror(err), rel)


def _refused(where: str) -> UnsafePath:
    return UnsafePath(f"refused path {where!r}: it goes through a symbolic link")


def _parts(rel: str | Path) -> list[str]:
    text = str(rel)
    return check_key(text).split("/") if text not in ("", ".") else []


def _walk(root_fd: int, parts: list[str], flags: int, mode: int, where: str) -> int:
    """Component-wise: every folder with O_DIRECTORY | O_NOFOLLOW, the last part with
    `flags | O_NOFOLLOW`."""
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    raise _refused(where) from None
                raise
            os.close(fd)
            fd = nxt
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(parts[-1], fd):
                raise _refused(where) from None
            raise
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_at(root: Path | int, rel: str | Path, flags: int, mode: int = 0o600) -> int:
    parts = _parts(rel)
    where = str(rel) or "."
    root_fd = root if isinstance(root, int) else os.open(root, _DIR)
    try:
        if not parts:
            if not flags & os.O_DIRECTORY:
                raise IsADirectoryError(where)
            return os.dup(root_fd)
        try:
            fd = _openat2(root_fd, "/".join(parts), flags | os.O_NOFOLLOW, mode)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EXDEV):  # a link (or `..`) somewhere on the way
                raise _refused(where) from None
            if e.errno not in (errno.ENOTDIR, errno.EAGAIN):
                raise
            # A link where a folder was asked for (the walk tells which it is), or a rename
            # raced the lookup (openat2 asks for a retry): the walk decides.
            fd = None
        if fd is not None:
            return fd
        return _walk(root_fd, parts, flags, mode, where)
    finally:
        if not isinstance(root, int):
            os.close(root_fd)


def open_dir(root: Path | int, rel: str | Path = "", create: bool = False) -> int:
    """The folder `root/rel` by descriptor (the caller closes it); `create`: the missing
    folders on the way are made (0755), never through a link."""
    try:
        return _open_at(root, rel, _DIR)
    except FileNotFoundError:
        if not create or not _parts(rel):
            raise
    fd = _open_at(root, "", _DIR)
    try:
        for part in _parts(rel):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            nxt = _open_at(fd, part, _DIR)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: Path | int, rel: str | Path) -> int:
    """`root/rel` opened for reading: a regular file, reached through no link (the caller
    closes it; blocking again)."""
    try:
        fd = _open_at(root, rel, _READ)
    except (NotADirectoryError, IsADirectoryError):
        raise FileNotFoundError(str(rel)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(f"{rel}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_file(root: Path | int, rel: str | Path, limit: int, offset: int = 0) -> bytes:
    """At most `limit` bytes of `root/rel` from `offset`."""
    fd = open_file(root, rel)
    try:
        return os.pread(fd, limit, offset)
    finally:
        os.close(fd)


def _blocks(fd: int) -> Iterator[bytes]:
    offset = 0
    while block := os.pread(fd, BLOCK, offset):
        offset += len(block)
        yield block


def hash_file(root: Path | int, rel: str | Path) -> tuple[str, int]:
    """(sha256, bytes) of `root/rel`, both measured from one descriptor."""
    fd = open_file(root, rel)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def hash_fd(fd: int) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    for block in _blocks(fd):
        h.update(block)
        n += len(block)
    return h.hexdigest(), n


def copy_out(root: Path | int, rel: str | Path, dest: Path) -> tuple[str, int]:
    """Copy `root/rel` to `dest` (a new file in a folder the job cannot write: O_EXCL, no
    link followed), hashing the bytes copied; (sha256, bytes)."""
    fd = open_file(root, rel)
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
        try:
            h, n = hashlib.sha256(), 0
            for block in _blocks(fd):
                h.update(block)
                n += len(block)
                _write_all(out, block)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return h.hexdigest(), n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace_file(root: Path | int, rel: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `root/rel` atomically: a fresh temporary name beside it (O_EXCL: never one
    the job planted), then a rename within its folder's descriptor. OSError when the job
    made that name a folder."""
    *folders, name = _parts(rel)
    dfd = open_dir(root, "/".join(folders), create=True)
    try:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode,
                     dir_fd=dfd)  # fmt: skip
        try:
            os.fchmod(fd, mode)  # whatever the umask: the sandbox's user reads it
            _write_all(fd, data)
        finally:
            os.close(fd)
        rename_over(dfd, tmp, name)
    finally:
        os.close(dfd)


def rename_over(dir_fd: int, tmp: str, name: str) -> None:
    """Rename `tmp` over `name` within one folder (by descriptor); the temporary file is
    removed when the rename fails."""
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def append_owned(root: Path | int, rel: str | Path, data: bytes) -> None:
    """Append to a file this process owns (created, 0644, when missing): a file of
    anyone else's by that name (the job replaced it) or a link is refused with
    PermissionError, and nothing is written."""
    fd = open_owned(root, rel, os.O_WRONLY | os.O_APPEND)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def open_owned(root: Path | int, rel: str | Path, flags: int, mode: int = 0o644) -> int:
    """`root/rel` opened with `flags | O_CREAT`, only if it is a regular file of this
    process's user (PermissionError otherwise; the caller closes it). A second name does
    not matter: inside its sandbox a job can link only files of its own folder, and the
    zygote's hand-over links the run dir's files on purpose."""
    try:
        fd = _open_at(root, rel, flags | os.O_CREAT | os.O_NONBLOCK | _CLOEXEC, mode)
    except UnsafePath as e:
        raise PermissionError(errno.ELOOP, str(e), str(rel)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(errno.EPERM, "not a file of the worker's own", str(rel))
    os.set_blocking(fd, True)
    return fd


def claim_owned(root: Path | int, name: str) -> None:
    """Make `root/name` a regular file of this process's user: kept as it is when it
    already is, else its bytes (when it is a regular file) copied into a fresh file that
    takes its name; a link, folder or FIFO in its place is renamed aside."""
    dfd = open_dir(root)
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        if stat.S_ISREG(st.st_mode):
            fd = open_file(dfd, name)
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                              0o644, dir_fd=dfd)  # fmt: skip
                try:
                    for block in _blocks(fd):
                        _write_all(out, block)
                finally:
                    os.close(out)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        else:
            os.rename(name, f"{name}.refused-{secrets.token_hex(4)}", src_dir_fd=dfd,
                      dst_dir_fd=dfd)  # fmt: skip
    finally:
        os.close(dfd)


def open_regular_rw(root: Path | int, rel: str | Path, flags: int, mode: int = 0o644) -> int:
    """`root/rel` opened with `flags | O_CREAT` whoever owns it (a file the job wrote, to cut
    or extend), reached through no link and only if it is a regular file (FileNotFoundError
    for a FIFO or a folder; the caller closes it)."""
    fd = _open_at(root, rel, flags | os.O_CREAT | os.O_NONBLOCK | _CLOEXEC, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(f"{rel}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def remove(root: Path | int, rel: str | Path) -> bool:
    """Unlink `root/rel` (a folder: its whole tree, links unlinked, never followed); False
    when it was not there."""
    *folders, name = _parts(rel)
    try:
        dfd = open_dir(root, "/".join(folders))
    except FileNotFoundError:
        return False
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(dfd, name)
        else:
            os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)


def discard(path: Path | str) -> None:
    """`remove` of a path whose folder is the worker's own, errors ignored (a clean-up)."""
    path = Path(path)
    with contextlib.suppress(OSError, UnsafePath):
        remove(path.parent, path.name)


def _rmtree_at(dir_fd: int, name: str) -> None:
    # With dir_fd, rmtree walks by descriptor and never enters a link (on Linux:
    # shutil.rmtree.avoids_symlink_attacks).
    shutil.rmtree(name, dir_fd=dir_fd)


def empty_dir(root: Path | int) -> None:
    """Remove everything `root` holds, the folder itself kept (a sandbox may bind it)."""
    fd = open_dir(root)
    try:
        for name in os.listdir(fd):
            remove(fd, name)
    finally:
        os.close(fd)


def chown_tree(
    root: Path | int, uid: int, gid: int, keep: Callable[[str], bool] = lambda name: False
) -> None:
    """Give `root`'s tree (root included) to uid:gid, links themselves and never their
    targets, walking by descriptor (os.fwalk): a folder swapped for a link meanwhile is
    not entered. `keep`: top-level names left as they are (the worker's own files)."""
    fd = open_dir(root)
    try:
        os.chown(fd, uid, gid)
        for top, dirs, files, dfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in dirs + files:
                if top == "." and keep(name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(fd)


def link_tree(src: Path | int, dst: Path | int, limit: int) -> None:
    """`dst` (empty) gets `src`'s tree: folders made anew (their modes kept), everything
    else hard-linked (links as themselves, never followed), by descriptor on both sides.
    OSError past `limit` entries."""
    todo = [(open_dir(src), open_dir(dst))]
    count = 0
    try:
        while todo:
            here, there = todo.pop()
            try:
                for entry in os.scandir(here):
                    count += 1
                    if count > limit:
                        raise OSError(f"over {limit} files in the run directory")
                    if entry.is_dir(follow_symlinks=False):
                        mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
                        os.mkdir(entry.name, mode, dir_fd=there)
                        todo.append((open_dir(here, entry.name), open_dir(there, entry.name)))
                    else:
                        os.link(entry.name, entry.name, src_dir_fd=here, dst_dir_fd=there,
                                follow_symlinks=False)  # fmt: skip
            finally:
                os.close(here)
                os.close(there)
    finally:
        for here, there in todo:
            os.close(here)
            os.close(there)


def copy_tree(src: Path, dst: Path | int) -> None:
    """`src` (a folder of the worker's own: an unpacked bundle) copied into `dst` (empty,
    one the job may write), modes kept, links recreated as links; nothing in `dst` is
    reached through a link."""
    for top, dirs, files in os.walk(src):
        rel = os.path.relpath(top, src)
        dfd = open_dir(dst, "" if rel == "." else rel, create=True)
        try:
            for name in dirs + files:
                path = os.path.join(top, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(path), name, dir_fd=dfd)
                elif stat.S_ISDIR(st.st_mode):
                    os.mkdir(name, stat.S_IMODE(st.st_mode), dir_fd=dfd)
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(path, dfd, name, stat.S_IMODE(st.st_mode))
        finally:
            os.close(dfd)


def _copy_file(path: str, dir_fd: int, name: str, mode: int) -> None:
    src = os.open(path, _READ)
    try:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode,
                      dir_fd=dir_fd)  # fmt: skip
        try:
            os.fchmod(out, mode)
            for block in _blocks(src):
                _write_all(out, block)
        finally:
            os.close(out)
    finally:
        os.close(src)
