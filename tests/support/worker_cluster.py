"""A real torchyard cluster for end-to-end tests and the benchmark: `torchyard api`,
`torchyard scheduler` and CPU workers as separate processes, TORCHYARD_* pointing at a
temporary home. Jobs go in over REST with a real token."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

FAST_SETTINGS = {
    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5",
    "TORCHYARD_HEARTBEAT_TIMEOUT_S": "4",
    "TORCHYARD_CANCEL_GRACE_S": "3",
    "TORCHYARD_RENDEZVOUS_TIMEOUT_S": "30",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(n: int) -> int:
    """A base port with `n` consecutive free ports from it (a free port's neighbour may
    well be taken: a lone free_port() + 1 failed once in CI)."""
    for _ in range(100):
        base = free_port()
        if base + n - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_for(cond: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """Poll `cond` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # a service still starting
            last_exc = e
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_mentioning(needle: str, *, standbys: bool = True) -> list[int]:
    """Live pids whose command line contains `needle` (e.g. a job's run directory). An idle
    warm trainer's sandbox names the folder it will hand its job (`.next-…` beside the run
    directories): `standbys=False` leaves those out, as they are no job's trainer (a
    zygote's sandbox counts while the zygote has a forked job in it)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cmd = _cmdline(int(d.name))
        if not standbys and "torchyard.trainer --standby" in cmd:
            continue
        if not standbys and "torchyard.trainer --zygote" in cmd and _idle_zygote(int(d.name)):
            continue
        if needle in cmd and pid_alive(int(d.name)):
            out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _idle_zygote(pid: int) -> bool:
    """`pid` is a zygote's sandbox (or in it) and the zygote runs no job: the one Python
    process of its tree running `--zygote` is the zygote itself (its forks, a job and what
    the job starts, keep its command line)."""
    from torchyard.worker.zygote import children

    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children(p))
    pythons = [p for p in tree if not _cmdline(p).startswith("bwrap ")]  # not bwrap, its init
    return sum("torchyard.trainer --zygote" in _cmdline(p) for p in pythons) <= 1


class Cluster:
    def __init__(
        self,
        tmp: Path,
        *,
        database_url: str | None = None,
        broker_url: str | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        self.env.update(FAST_SETTINGS)
        self.env.update(
            TORCHYARD_HOME=str(self.home),
            TORCHYARD_QUEUE_PREFIX=f"tyt-{uuid.uuid4().hex[:10]}",
            PYTHONUNBUFFERED="1",
            # Two cores shared by everything: keep each trainer to one thread.
            OMP_NUM_THREADS="1",
        )
        if database_url:
            self.env["TORCHYARD_DATABASE_URL"] = database_url
        if broker_url:
            self.env["TORCHYARD_BROKER_URL"] = broker_url
        self.env.update(extra_env or {})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self._http: httpx.Client | None = None

    # ---- settings and store access from the test process ----------------------------------

    def settings(self) -> Any:
        from torchyard.settings import Settings

        keys = {k: v for k, v in self.env.items() if k.startswith("TORCHYARD_")}
        old = {k: os.environ.get(k) for k in keys}
        os.environ.update(keys)
        try:
            return Settings(_env_file=None)  # type: ignore[call-arg]
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @property
    def db_url(self) -> str:
        return str(self.settings().db_url)

    @property
    def storage(self) -> Path:
        return Path(self.settings().storage)

    def session(self) -> Any:
        from torchyard.store.db import session_scope

        return session_scope(self.db_url)

    # ---- processes ---------------------------------------------------------------------

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        p = subprocess.Popen(
            [sys.executable, "-m", "torchyard", *args],
            cwd=ROOT,
            env=self.env | (env or {}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = p
        return p

    def log_of(self, name: str) -> str:
        try:
            return (self.tmp / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, workers: int = 2, schedulers: int = 1) -> Cluster:
        # Its lines (one per migration) only when it fails: benches print their own figures.
        done = subprocess.run(
            [sys.executable, "-m", "torchyard", "db", "upgrade"],
            cwd=ROOT, env=self.env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(
                f"torchyard db upgrade: exit {done.returncode}\n{done.stdout}{done.stderr}"
            )
        from torchyard.store.auth import create_token

        with self.session() as s:
            self.token = create_token(s, "tester", admin=True)
        self._spawn("api", ["api", "--host", "127.0.0.1", "--port", str(self.port)])
        for i in range(schedulers):
            name = "scheduler" if i == 0 else f"scheduler{i}"
            self._spawn(name, ["scheduler", "--log-level", "INFO"])
        for i in range(workers):
            self.start_worker(f"w{i}")
        try:
            wait_for(self._api_up, 60, "the API")
        except TimeoutError as e:
            # What the API said is the only clue on a machine whose run leaves nothing behind.
            raise TimeoutError(f"{e}\n--- api log (tail) ---\n{self.log_of('api')[-4000:]}") from e
        if workers:
            self.wait_workers(workers)
        return self

    def _api_up(self) -> bool:
        api = self.procs["api"]
        if api.poll() is not None:
            raise RuntimeError(f"the API exited with {api.returncode}")
        return self.http.get("/healthz").status_code == 200

    def start_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self._spawn(name, ["worker", "--device", "cpu", "--name", name], env)

    def wait_workers(
        self, n: int, state: str = "idle", timeout: float = 60
    ) -> list[dict[str, Any]]:
        def ready() -> list[dict[str, Any]] | None:
            items = self.get("/v1/workers")["items"]
            live = [w for w in items if w["state"] == state]
            return live if len(live) >= n else None

        return wait_for(ready, timeout, f"{n} {state} workers")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait(timeout=30)

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self._http is not None:
            self._http.close()

    # ---- REST --------------------------------------------------------------------------

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(
                base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
            )
        return self._http

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        r.raise_for_status()
        return r.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/jobs/{job_id}")

    def wait_state(
        self, job_id: str, states: str | tuple[str, ...], timeout: float = 120
    ) -> dict[str, Any]:
        want = (states,) if isinstance(states, str) else states

        def check() -> dict[str, Any] | None:
            j = self.job(job_id)
            if j["state"] in want:
                return j
            if j["state"] in ("succeeded", "failed", "cancelled"):
                raise AssertionError(f"job ended {j['state']} (wanted {want}): {j.get('error')}")
            return None

        try:
            return wait_for(check, timeout, f"job {job_id} to be {want}", every=0.1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- job log ---\n{self.job_log(job_id)[-3000:]}") from None

    def job_log(self, job_id: str) -> str:
        from torchyard.store.paths import LOG_FILE, job_dir

        p = job_dir(self.storage, job_id) / LOG_FILE
        return p.read_text(errors="replace") if p.exists() else ""

    def metrics(self, job_id: str, name: str) -> tuple[list[int], list[float]]:
        m = self.get(f"/v1/jobs/{job_id}/metrics", name=name)
        s = m["series"].get(name, {"steps": [], "values": []})
        return s["steps"], s["values"]


# ---- what a test reads of a job, beside the REST answers ---------------------------------


def job_events(c: Cluster, job_id: str) -> list[dict[str, Any]]:
    from torchyard.store.paths import EVENTS_FILE, job_dir

    p = job_dir(c.storage, job_id) / EVENTS_FILE
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def job_weights(c: Cluster, job_id: str) -> dict[str, torch.Tensor]:
    from torchyard.store.paths import job_dir

    return load_file(str(job_dir(c.storage, job_id) / "model.safetensors"))


def running_worker(c: Cluster, job_id: str) -> str:
    j = c.job(job_id)
    return j["attempts"][-1]["workers"][0]["worker_id"]


def trainer_pid(c: Cluster, job_id: str) -> int:
    from torchyard.store.models import Assignment

    def pid() -> int | None:
        with c.session() as s:
            return s.scalar(
                select(Assignment.pid)
                .where(Assignment.job_id == job_id, Assignment.ended_at.is_(None))
                .order_by(Assignment.id.desc())
            )

    return wait_for(pid, 60, "the trainer's pid")


def checkpointed_and_running(c: Cluster, job_id: str, min_step: int) -> bool:
    j = c.job(job_id)
    if j["state"] != "running":
        return False
    cks = c.get(f"/v1/jobs/{job_id}/checkpoints")["items"]
    return any(ck["step"] >= min_step for ck in cks)


def backend_cluster(
    request: Any,
    tmp_path_factory: Any,
    *,
    workers: int = 2,
    schedulers: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """The body of a module-scoped `cluster` fixture parametrised by backend: "embedded"
    (SQLite + the filesystem broker) or "redis-postgres" (a fresh PostgreSQL database on
    the shared server, dropped after, and Redis)."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        c = Cluster(tmp, extra_env=extra_env)
    else:
        from support.db import drop_pg_databases, new_pg_database

        make = new_pg_database(request.getfixturevalue("pg_url"))
        request.addfinalizer(lambda: drop_pg_databases(make))
        c = Cluster(
            tmp,
            database_url=make(),
            broker_url=request.getfixturevalue("redis_url"),
            extra_env=extra_env,
        )
    try:
        yield c.start(workers=workers, schedulers=schedulers)
    finally:
        c.stop()


# The `params` of such a fixture: one shape where the shape is not the module's subject,
# BOTH_SHAPES where it is (listed with why in tests/BACKENDS.md, kept true by
# tests/test_backends_list.py). Each shape starts its own cluster, so a module on both
# costs twice: ~10 s of start-up plus every test again.
EMBEDDED = "embedded"
REDIS_POSTGRES = pytest.param("redis-postgres", marks=[pytest.mark.redis, pytest.mark.postgres])
BOTH_SHAPES = [EMBEDDED, REDIS_POSTGRES]


@contextlib.contextmanager
def s3_cluster(
    request: Any, tmp: Path, s3_server: Any, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A cluster on a fresh PostgreSQL database, the shared Redis and a fresh bucket of the
    session's SeaweedFS, with no worker yet (each test starts its "hosts": their own home
    and cache). Yields it and the object-store settings every host needs."""
    from support.db import drop_pg_databases, new_pg_database

    make = new_pg_database(request.getfixturevalue("pg_url"))
    request.addfinalizer(lambda: drop_pg_databases(make))
    env = s3_server.env() | {
        "TORCHYARD_STORAGE_URL": f"s3://{s3_server.make_bucket()}/cluster",
        "TORCHYARD_S3_ENDPOINT_URL": s3_server.endpoint_url,
    }
    c = Cluster(
        tmp,
        database_url=make(),
        broker_url=request.getfixturevalue("redis_url"),
        extra_env=env | (extra_env or {}),
    )
    c.start(workers=0)
    try:
        yield c, env
    finally:
        c.stop()
