"""The cluster under test: API, scheduler and two CPU workers on this host, a third worker
on the second host (its own network namespace), all on the private PostgreSQL and Redis,
every file in an object store (a private SeaweedFS, its S3 endpoint on the veth address
both hosts reach). No directory is shared: the API (with the scheduler), this host's
workers and the second host's worker each have their own TORCHYARD_HOME and storage root
(a cache); this host's workers' cache is a small tmpfs that can be filled."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from netns import SecondHost
from seaweed import Seaweed
from support.services import PrivatePostgres, PrivateRedis
from support.worker_cluster import ROOT, Cluster, wait_for

from torchyard.storage import Storage

# Heartbeat timeout T = 4 s: a cut-off or frozen worker's trainer is gone within 0.6 T.
CHAOS_SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_HEARTBEAT_TIMEOUT_S": "4",
    "TORCHYARD_CLAIM_TIMEOUT_S": "15",
    "TORCHYARD_CANCEL_GRACE_S": "3",
    "TORCHYARD_RENDEZVOUS_TIMEOUT_S": "30",
    "TORCHYARD_TRAINER_THREADS": "1",
    # The webhook sender's lease (2 x this + 5 s) expires soon after a scheduler is killed.
    "TORCHYARD_WEBHOOK_TIMEOUT_S": "2",
    "TORCHYARD_WEBHOOK_RETRY_BASE_S": "1",
    # The test's receiver listens on loopback, which webhooks reach only when allowed.
    "TORCHYARD_WEBHOOK_ALLOW_NETWORKS": "127.0.0.1/32",
}
# Room for a long run's cached checkpoints; the disk_full fault fills whatever is left.
TMPFS_SIZE = "1g"
REMOTE = "wr"  # the worker on the second host
BUCKET = "torchyard-chaos"


class ChaosCluster(Cluster):
    def __init__(
        self,
        tmp: Path,
        pg: PrivatePostgres,
        redis: PrivateRedis,
        host2: SecondHost,
        s3: Seaweed,
    ):
        self.pg, self.redis, self.host2, self.s3 = pg, redis, host2, s3
        self.s3_env = s3.env() | {
            "TORCHYARD_STORAGE_URL": f"s3://{s3.make_bucket(BUCKET)}/chaos",
            "TORCHYARD_S3_ENDPOINT_URL": s3.endpoint_url,
        }
        # This host's workers: their home and their cache, the tmpfs.
        self.local_home = tmp / "host1" / "home"
        self.storage_root = tmp / "host1" / "cache"
        self.storage_root.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                        str(self.storage_root)], check=True)  # fmt: skip
        self.remote_home = tmp / "host2" / "home"
        self.remote_root = tmp / "host2" / "cache"
        # The API and the scheduler: TORCHYARD_HOME is tmp/home, their cache in it.
        super().__init__(
            tmp,
            database_url=pg.url(),
            broker_url=redis.url(),
            extra_env={
                **CHAOS_SETTINGS,
                **self.s3_env,
                "TORCHYARD_ADVERTISE_ADDR": host2.root_addr,
                "GLOO_SOCKET_IFNAME": host2.root_if,
            },
        )
        self.local_env = {
            "TORCHYARD_HOME": str(self.local_home),
            "TORCHYARD_STORAGE_ROOT": str(self.storage_root),
        }
        self.remote_env = {
            **self.env,
            "TORCHYARD_DATABASE_URL": pg.url(host=host2.root_addr),
            "TORCHYARD_BROKER_URL": redis.url(host=host2.root_addr),
            "TORCHYARD_ADVERTISE_ADDR": host2.addr,
            "GLOO_SOCKET_IFNAME": host2.ns_if,
            "TORCHYARD_HOME": str(self.remote_home),
            "TORCHYARD_STORAGE_ROOT": str(self.remote_root),
        }

    @property
    def caches(self) -> list[Path]:
        """Every worker host's storage root: where trainers wrote their run directories."""
        return [self.storage_root, self.remote_root]

    def object_store(self, cache: Path) -> Storage:
        """The cluster's object store as a service sees it, with `cache` as its storage
        root (boto3 reads the AWS_* credentials from the environment: set `s3_env`)."""
        from torchyard.settings import Settings
        from torchyard.storage import open_storage

        url = self.s3_env["TORCHYARD_STORAGE_URL"]
        settings = Settings(  # type: ignore[call-arg]
            _env_file=None,
            home=self.home,
            storage_root=cache,
            storage_url=url,
            s3_endpoint_url=self.s3_env["TORCHYARD_S3_ENDPOINT_URL"],
        )
        return open_storage(url, settings)

    def start_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        if name != REMOTE:
            return super().start_worker(name, self.local_env | (env or {}))
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

    def wait_registered(self, name: str, timeout: float = 120) -> None:
        """Until the worker process just started has registered (its row shows its pid): a
        worker that is still starting when the next outage begins exits (it cannot
        register), so each start is awaited before the next fault."""
        p = self.procs[name]

        def registered() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"worker {name} exited ({p.returncode}) while starting")
            w = self.workers().get(name)
            return w is not None and w["pid"] == p.pid

        try:
            wait_for(registered, timeout, f"worker {name} to register", every=0.25)
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.log_of(name)[-2000:]}") from None

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
