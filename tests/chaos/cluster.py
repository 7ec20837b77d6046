"""The cluster under test: API, scheduler and two CPU workers on this host, a third worker
on the second host (its own network namespace), all on the private PostgreSQL and Redis,
the storage root on a small tmpfs that can be filled."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from netns import SecondHost
from services import PrivatePostgres, PrivateRedis
from worker_cluster import ROOT, Cluster, wait_for

# Heartbeat timeout T = 4 s: a cut-off or frozen worker's trainer is gone within 0.6 T.
CHAOS_SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_HEARTBEAT_TIMEOUT_S": "4",
    "TORCHYARD_CLAIM_TIMEOUT_S": "15",
    "TORCHYARD_CANCEL_GRACE_S": "3",
    "TORCHYARD_RENDEZVOUS_TIMEOUT_S": "30",
    "TORCHYARD_TRAINER_THREADS": "1",
}
# Room for a long run's checkpoints; the disk_full fault fills whatever is left.
TMPFS_SIZE = "1g"
REMOTE = "wr"  # the worker on the second host


class ChaosCluster(Cluster):
    def __init__(self, tmp: Path, pg: PrivatePostgres, redis: PrivateRedis, host2: SecondHost):
        self.pg, self.redis, self.host2 = pg, redis, host2
        self.storage_root = tmp / "storage"
        self.storage_root.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                        str(self.storage_root)], check=True)  # fmt: skip
        super().__init__(
            tmp,
            database_url=pg.url(),
            broker_url=redis.url(),
            extra_env={
                **CHAOS_SETTINGS,
                "TORCHYARD_STORAGE_ROOT": str(self.storage_root),
                "TORCHYARD_ADVERTISE_ADDR": host2.root_addr,
                "GLOO_SOCKET_IFNAME": host2.root_if,
            },
        )
        self.remote_env = {
            **self.env,
            "TORCHYARD_DATABASE_URL": pg.url(host=host2.root_addr),
            "TORCHYARD_BROKER_URL": redis.url(host=host2.root_addr),
            "TORCHYARD_ADVERTISE_ADDR": host2.addr,
            "GLOO_SOCKET_IFNAME": host2.ns_if,
            "TORCHYARD_HOME": str(tmp / "home-remote"),
        }

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        if name != REMOTE:
            return super().start_worker(name)
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        argv = [sys.executable, "-m", "torchyard", "worker", "--device", "cpu", "--name", name]
        p = subprocess.Popen([*self.host2.prefix(), *argv], cwd=ROOT, env=self.remote_env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        log.close()
        self.procs[name] = p
        return p

    def start_services(self) -> None:
        """Migrate, make the admin token, start the API and the scheduler (workers apart)."""
        subprocess.run([sys.executable, "-m", "torchyard", "db", "upgrade"], cwd=ROOT,
                       env=self.env, check=True)  # fmt: skip
        from torchyard.store.auth import create_token

        with self.session() as s:
            self.token = create_token(s, "tester", admin=True)
        self.restart("api")
        self.restart("scheduler")
        wait_for(lambda: self.http.get("/healthz").status_code == 200, 60, "the API")

    def restart(self, name: str) -> None:
        args = {"api": ["api", "--host", "127.0.0.1", "--port", str(self.port)],
                "scheduler": ["scheduler", "--log-level", "INFO"]}  # fmt: skip
        if name in args:
            self._spawn(name, args[name])
        else:
            self.start_worker(name)

    def tolerant_get(self, path: str, timeout: float = 120, **params: Any) -> Any:
        """GET that waits out an API restart or a store outage (503)."""

        def attempt() -> Any:
            r = self.http.get(path, params=params)
            return r.json() if r.status_code == 200 else None

        return wait_for(attempt, timeout, f"GET {path}", every=0.25)

    def tolerant_submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        def attempt() -> Any:
            r = self.http.post("/v1/jobs", json=spec)
            if r.status_code == 201:
                return r.json()
            assert r.status_code in (502, 503), r.text  # only an outage may refuse it
            return None

        return wait_for(attempt, 120, "a submit", every=0.25)

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["id"]: w for w in self.tolerant_get("/v1/workers")["items"]}

    def busy_worker(self, among: list[str], timeout: float = 30) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                ws = self.workers()
                busy = [w for w in among if ws.get(w, {}).get("state") == "busy"]
                if busy:
                    return busy[0]
            time.sleep(0.2)
        return None

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        for p in self.procs.values():  # the remote worker sits under `ip netns exec`
            with contextlib.suppress(ProcessLookupError, PermissionError):
                import os
                import signal

                os.killpg(p.pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(self.storage_root)], check=False)
