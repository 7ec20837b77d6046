"""Webhook latency: from a job's end (the commit of its state change) to the receiver
getting the POST, through the real `torchyard scheduler` process at its default poll
interval (TORCHYARD_WEBHOOK_POLL_S, 1 s).

    .venv/bin/python bench/webhook_latency_bench.py              # PostgreSQL (local)
    .venv/bin/python bench/webhook_latency_bench.py --sqlite
    .venv/bin/python bench/webhook_latency_bench.py --wake       # + a scheduler wake-up per end

Ends --jobs jobs through the store (running → succeeded, one transaction each, spaced by
--gap-ms), each delivered to a receiver (`http.server` on 127.0.0.1) that records when it
arrived; prints p50 / p99 / max. `--wake` sends the scheduler the wake-up a worker sends
after a job's end (broker/app.py: wake_scheduler), which wakes the sender too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchlib import ROOT, STORE_SPEC, pct, scratch_postgres

from torchyard.settings import Settings
from torchyard.store.auth import get_or_create_user
from torchyard.store.db import session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import upgrade
from torchyard.store.states import transition
from torchyard.store.webhooks import create_webhook

PG_ADMIN = os.environ.get(
    "TORCHYARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextmanager
def receiver() -> Iterator[tuple[str, dict[str, float]]]:
    """A receiver on a free port: (its URL, job id -> arrival time)."""
    arrived: dict[str, float] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            arrived.setdefault(json.loads(body)["job"]["id"], time.time())
            self.send_response(204)
            self.end_headers()

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # socketserver's 5 drops concurrent connects' SYNs (1 s)

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", arrived
    finally:
        server.shutdown()


@contextmanager
def database(sqlite: bool, home: Path) -> Iterator[str]:
    if sqlite:
        url = f"sqlite:///{home / 'bench.db'}"
        upgrade(url)
        yield url
    else:
        with scratch_postgres(PG_ADMIN, f"ty_webhook_bench_{uuid.uuid4().hex[:8]}") as url:
            yield url


def end_jobs(url: str, n: int, gap_s: float, wake: Settings | None) -> dict[str, float]:
    """n jobs of `bench` driven to running, then each ended in its own transaction: job id
    -> the time its commit returned."""
    with session_scope(url) as s:
        uid = get_or_create_user(s, "bench").id
        jobs = [create_job(s, uid, dict(STORE_SPEC), name=f"j{i}")[0] for i in range(n)]
        for job in jobs:
            transition(s, job, "starting")
            transition(s, job, "running")
        ids = [j.id for j in jobs]
    ended: dict[str, float] = {}
    rng = random.Random(0)
    for jid in ids:
        time.sleep(gap_s * rng.uniform(0.5, 1.5))  # spread over the poll interval
        with session_scope(url) as s:
            from torchyard.store.models import Job

            job = s.get(Job, jid)
            assert job is not None
            transition(s, job, "succeeded")
        ended[jid] = time.time()
        if wake is not None:
            from torchyard.broker.app import wake_scheduler

            wake_scheduler(wake)
    return ended


def run(args: argparse.Namespace) -> None:
    with ExitStack() as stack:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ty-whbench-")))
        url = stack.enter_context(database(args.sqlite, home))
        target, arrived = stack.enter_context(receiver())
        with session_scope(url) as s:
            uid = get_or_create_user(s, "bench").id
            create_webhook(s, uid, None, target, ["job.succeeded"], "bench-secret-0123456789")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        # The receiver listens on loopback, which webhooks reach only when allowed.
        env.update(TORCHYARD_HOME=str(home), TORCHYARD_DATABASE_URL=url,
                   TORCHYARD_QUEUE_PREFIX=f"tywb-{uuid.uuid4().hex[:8]}",
                   TORCHYARD_WEBHOOK_ALLOW_NETWORKS="127.0.0.1/32")  # fmt: skip
        sched = subprocess.Popen([sys.executable, "-m", "torchyard", "scheduler"], cwd=ROOT,
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stack.callback(sched.wait)
        stack.callback(sched.kill)
        time.sleep(4)  # the scheduler process up
        wake = None
        if args.wake:
            os.environ.update(env)
            wake = Settings(_env_file=None)  # type: ignore[call-arg]
        ended = end_jobs(url, args.jobs, args.gap_ms / 1000, wake)
        deadline = time.monotonic() + 60
        while len(arrived) < len(ended) and time.monotonic() < deadline:
            time.sleep(0.1)
        lat = [(arrived[j] - t) * 1000 for j, t in ended.items() if j in arrived]
        db = "SQLite" if args.sqlite else "PostgreSQL"
        how = "poll + wake-up per end" if args.wake else "poll only (1 s)"
        print(f"webhook latency, job end committed -> POST received ({db}, {how}):")
        print(f"  delivered {len(lat)}/{len(ended)}")
        print(f"  p50 {pct(lat, 50):.0f} ms   p99 {pct(lat, 99):.0f} ms   max {max(lat):.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=25.0, help="mean time between job ends")
    p.add_argument("--sqlite", action="store_true", help="SQLite instead of PostgreSQL")
    p.add_argument("--wake", action="store_true", help="wake the scheduler after each end")
    run(p.parse_args())


if __name__ == "__main__":
    main()
