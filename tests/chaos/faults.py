"""The fault injector: each kind of fault, done to the real processes and services at a
seeded random moment, logged with the time it took."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from cluster import REMOTE, ChaosCluster

LOCAL_WORKERS = ["w0", "w1"]


class Injector:
    def __init__(
        self, c: ChaosCluster, rng: random.Random, *, long: bool, log: Callable[[str], None]
    ):
        self.c, self.rng, self.long, self.log = c, rng, long, log
        self.t = float(c.env["TORCHYARD_HEARTBEAT_TIMEOUT_S"])
        self.done: Counter[str] = Counter()
        self.stall_checks: list[float] = []  # GET job latency while downloads were stalled
        self.failures: list[str] = []  # faults whose own checks failed, with the traceback

    # ---- the faults ---------------------------------------------------------------------

    def _target(self) -> str:
        busy = self.c.busy_worker(LOCAL_WORKERS)
        w = busy or self.rng.choice(LOCAL_WORKERS)
        self.log(f"  target {w} ({'busy' if busy else 'idle'})")
        return w

    def kill_worker(self) -> None:
        w = self._target()
        self.c.kill(w, signal.SIGKILL)
        time.sleep(self.rng.uniform(0.5, 2))
        self.c.restart(w)
        self.c.wait_registered(w)

    def kill_scheduler(self) -> None:
        self.c.kill("scheduler", signal.SIGKILL)
        time.sleep(self.rng.uniform(0.5, 3))
        self._restart_until_up("scheduler", lambda: False)

    def kill_api(self) -> None:
        self.c.kill("api", signal.SIGKILL)
        time.sleep(self.rng.uniform(0.5, 2))
        healthy = lambda: self.c.http.get("/healthz").status_code == 200  # noqa: E731
        self._restart_until_up("api", healthy, settle_s=float("inf"))

    def _restart_until_up(self, name: str, up: Callable[[], bool], settle_s: float = 10) -> None:
        """Start `name` again as compose's `restart: unless-stopped` would: a service checks
        its storage at start and exits when the object store is away (the next fault may be
        its outage), so one that exits is started again until it is up (`up()`, or still
        running after `settle_s`)."""
        self.c.restart(name)
        started, deadline = time.monotonic(), time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if self.c.procs[name].poll() is not None:
                self.log(f"  {name} exited at its start: started again")
                self.c.restart(name)
                started = time.monotonic()
                continue
            with contextlib.suppress(Exception):
                if up():
                    return
            if time.monotonic() - started >= settle_s:
                return
        raise AssertionError(f"{name} did not come back up within 120 s")

    def freeze_worker(self) -> None:
        w = self._target()
        os.kill(self.c.procs[w].pid, signal.SIGSTOP)
        try:
            time.sleep(self.t * 1.5 + self.rng.uniform(0, 2))
        finally:
            os.kill(self.c.procs[w].pid, signal.SIGCONT)

    def pg_outage(self) -> None:
        lo, hi = (30, 45) if self.long else (30, 34)
        self.c.pg.stop()
        try:
            time.sleep(self.rng.uniform(lo, hi))
        finally:
            self.c.pg.start()

    def redis_restart(self) -> None:
        self.c.redis.restart()

    def stalled_downloads(self) -> None:
        job = self._job_with_checkpoint()
        if job is None:
            return
        socks = []
        try:
            for _ in range(12):
                socks.append(self._stall(job))
            for _ in range(5):
                t0 = time.monotonic()
                r = self.c.http.get(f"/v1/jobs/{job}", timeout=10)
                assert r.status_code == 200, r.text
                self.stall_checks.append(time.monotonic() - t0)
                time.sleep(0.5)
        finally:
            for s in socks:
                s.close()

    def disk_full(self) -> None:
        filler = self.c.storage_root / ".filler"
        try:
            with open(filler, "wb") as f:
                block = b"\0" * (1 << 20)
                while True:
                    f.write(block)
                    f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        try:
            time.sleep(self.rng.uniform(2, 5))
        finally:
            filler.unlink()

    def partition(self) -> None:
        busy = self.c.busy_worker([REMOTE], timeout=40)
        self.log(f"  cutting {REMOTE} ({'busy' if busy else 'idle'})")
        self.c.host2.cut()
        try:
            time.sleep(self.t * 1.5 + self.rng.uniform(0, 3))
        finally:
            self.c.host2.restore()

    def object_store_outage(self) -> None:
        """The object store goes away for a while, both ways, in a seeded order: frozen
        (SIGSTOP: connections open but nothing answers, then SIGCONT) and crashed (SIGKILL,
        then started again on the same ports and data: connections refused meanwhile).
        Trainers go on, their checkpoints wait on the hosts' disks and go up after."""
        frozen, down = ((10, 30), (1, 10)) if self.long else ((3, 5), (0, 1))
        ways = ["freeze", "crash"]
        self.rng.shuffle(ways)
        for way in ways:
            t0 = time.monotonic()
            if way == "freeze":
                self.c.s3.pause()
                try:
                    time.sleep(self.rng.uniform(*frozen))
                finally:
                    self.c.s3.resume()
            else:  # a restart takes a few seconds more (its master elects itself)
                self.c.s3.restart(down_s=self.rng.uniform(*down))
            self.log(f"  object store {way}: away {time.monotonic() - t0:.1f}s")

    KINDS = ("kill_worker", "kill_scheduler", "kill_api", "freeze_worker", "pg_outage",
             "redis_restart", "stalled_downloads", "disk_full", "partition",
             "object_store_outage")  # fmt: skip

    # ---- helpers -------------------------------------------------------------------------

    def _job_with_checkpoint(self) -> str | None:
        """The job with the biggest checkpoint so far (bigger than socket buffers, so a
        stalled client really leaves the server blocked mid-body)."""
        for _ in range(60):
            best: tuple[int, str] | None = None
            with contextlib.suppress(Exception):
                for j in self.c.tolerant_get("/v1/jobs", limit=50)["items"]:
                    for ck in self.c.tolerant_get(f"/v1/jobs/{j['id']}/checkpoints")["items"]:
                        if best is None or ck["bytes"] > best[0]:
                            best = (ck["bytes"], str(j["id"]))
            if best is not None and best[0] > 0:
                return best[1]
            time.sleep(0.5)
        return None

    def _stall(self, job: str) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.c.port), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.sendall(f"GET /v1/jobs/{job}/checkpoints/latest/download HTTP/1.1\r\nHost: t\r\n"
                  f"Authorization: Bearer {self.c.token}\r\n\r\n".encode())  # fmt: skip
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1)
            if not chunk:
                break
            head += chunk
        return s

    # ---- the schedule --------------------------------------------------------------------

    def run(self, until: float, stop: threading.Event) -> None:
        """Every kind once, in a seeded order; in a long run, then more at random until
        `until` (monotonic)."""
        order = list(self.KINDS)
        self.rng.shuffle(order)
        while not stop.is_set():
            if not order:
                if not self.long or time.monotonic() >= until:
                    return
                order = [self.rng.choice(self.KINDS)]
            kind = order.pop(0)
            # A soak leaves the cluster time to make progress between faults.
            stop.wait(self.rng.uniform(4, 12) if self.long else self.rng.uniform(1, 4))
            t0 = time.monotonic()
            self.log(f"fault {kind} ...")
            try:
                getattr(self, kind)()
            except Exception:  # recorded for the test to report; the run goes on
                self.failures.append(f"fault {kind}: {traceback.format_exc()}")
                self.log(f"fault {kind} FAILED after {time.monotonic() - t0:.1f}s")
                continue
            self.done[kind] += 1
            self.log(f"fault {kind} done in {time.monotonic() - t0:.1f}s")


def describe_processes(pids: list[int]) -> list[str]:
    """`pid: command line` of each (what a failed leftover check shows)."""
    out = []
    for pid in pids:
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid}: {cmd[:400]}")
    return out


def leftover_trainers(caches: list[Path]) -> list[int]:
    """Trainers (not idle standbys) still running in a run directory of any host."""
    from support.worker_cluster import processes_mentioning

    return sorted({p for c in caches for p in processes_mentioning(str(c), standbys=False)})
