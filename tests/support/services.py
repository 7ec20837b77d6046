"""Private PostgreSQL and Redis for the fault suite (tests/chaos) and the tests that stop
a database under a reader (tests/api/test_api_asyncreads.py) or run a Slurm cluster
(tests/deploy/test_slurm.py): started here, on free ports, stopped and restarted at will.
The machine's shared instances are never touched."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(host: str, port: int, up: bool, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not go {'up' if up else 'down'} in {timeout}s")


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def missing_tools() -> list[str]:
    """What the suite needs that this machine lacks (the test fails under CI, skips here)."""
    out = []
    if pg_bin() is None:
        out.append("initdb/pg_ctl (PostgreSQL server)")
    for tool in ("redis-server", "ip", "runuser", "mount", "unshare"):
        if shutil.which(tool) is None:
            out.append(tool)
    if os.geteuid() != 0:
        out.append("root (network namespaces, tmpfs mounts)")
    return out


class PrivatePostgres:
    """`initdb` + `pg_ctl` as the postgres user, trust auth, on a free port, listening on
    127.0.0.1 and any extra address (the second host reaches it over the veth)."""

    def __init__(self, listen: tuple[str, ...] = ("127.0.0.1",)):
        bindir = pg_bin()
        assert bindir is not None
        self.bin = bindir
        self.port = free_port()
        self.listen = listen
        self.dir = Path(tempfile.mkdtemp(prefix="ty-chaos-pg-"))
        os.chmod(self.dir, 0o755)
        self.data = self.dir / "data"
        self.data.mkdir()
        shutil.chown(self.data, "postgres", "postgres")
        self._as_pg(
            [str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"]
        )
        with open(self.data / "pg_hba.conf", "a") as f:  # the second host, over the veth
            f.write("host all all 10.201.0.0/16 trust\n")

    def _as_pg(self, argv: list[str]) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip

    def url(self, host: str = "127.0.0.1", db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{db}"

    def start(self) -> None:
        # Their subject is process faults, not disk durability: fsync=off and
        # full_page_writes=off only matter when the machine itself crashes (the OS's page
        # cache lost, a page torn), which no test here does. synchronous_commit stays on: a
        # `pg_ctl -m immediate` stop (the outage fault) is a server crash, and an
        # asynchronous commit not yet flushed from the WAL buffers would be lost in it, so
        # "nothing acknowledged is lost" could no longer be asserted. With fsync off, a
        # synchronous commit is a write() into the page cache: nothing to gain from it.
        opts = (
            f"-p {self.port} -k {self.data} -c listen_addresses='{','.join(self.listen)}' "
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._as_pg([str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-w",
                     "-l", str(self.data / "server.log"), "start"])  # fmt: skip
        _wait_port("127.0.0.1", self.port, up=True)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._as_pg([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                         "-w", "stop"])  # fmt: skip
        _wait_port("127.0.0.1", self.port, up=False)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    def __init__(self, bind: tuple[str, ...] = ("127.0.0.1",)):
        self.port = free_port()
        self.bind = bind
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"redis://{host}:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", *self.bind, "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port("127.0.0.1", self.port, up=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _wait_port("127.0.0.1", self.port, up=False)

    def restart(self) -> None:
        self.stop()
        self.start()
