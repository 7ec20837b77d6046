"""Restarting Redis (the broker) mid-job loses no job: the store is the truth and the
broker only a wake-up. Uses a private redis-server (never the shared one), without
persistence, so a restart loses every queued message."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.db import drop_pg_databases, new_pg_database
from support.worker_cluster import Cluster, free_port, wait_for
from test_e2e import DIGITS, LONG

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]


class PrivateRedis:
    def __init__(self, tmp: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed") if _ci() else pytest.skip(
                "no redis-server"
            )
        self.binary, self.tmp, self.port = str(binary), tmp, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # fmt: off
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.tmp)]
        # fmt: on
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        wait_for(up, 20, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None


def _ci() -> bool:
    import os

    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def redis_private(tmp_path: Path) -> Iterator[PrivateRedis]:
    r = PrivateRedis(tmp_path)
    r.start()
    yield r
    r.stop()


def test_restarting_redis_mid_job_loses_no_job(
    tmp_path: Path, pg_url: str, redis_private: PrivateRedis
) -> None:
    make = new_pg_database(pg_url)
    c = Cluster(tmp_path / "cluster", database_url=make(), broker_url=redis_private.url)
    try:
        c.start(workers=2)
        running = c.submit(LONG)
        c.wait_state(running["id"], "running", timeout=120)
        redis_private.stop()
        # Submitting while the broker is down still works: the tick schedules it later.
        during = c.submit(DIGITS)
        redis_private.start()
        after = c.submit(DIGITS)
        for job in (running, during, after):
            c.wait_state(job["id"], "succeeded", timeout=240)
        assert c.job(running["id"])["attempt"] == 1  # the running trainer was never disturbed
    finally:
        c.stop()
        drop_pg_databases(make)
