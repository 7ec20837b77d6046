"""Helpers shared by the test suites (tests/ is on pytest's path): process checks, and
small gzip tars for the bundle tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (exited, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_dies_with_parent(parent: subprocess.Popen, child: int, what: str) -> None:
    """SIGKILL `parent`; `child` (its running child) must be gone within 10 s. Both are
    killed in the end whatever happens."""
    try:
        assert alive(child), f"the {what} should be running"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(child), f"the {what} outlived its parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def tar_gz(members: dict[str, bytes]) -> bytes:
    """A gzip-compressed tar of regular files, named as given (hostile names included)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()
