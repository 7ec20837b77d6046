"""API benchmark on PostgreSQL: GET /v1/jobs/{id} throughput and latency at 32 concurrent
clients against one uvicorn process, and a 1,000,000-point loss curve fetched with
max_points=1000.

    .venv/bin/python bench/api_bench.py [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
        [--jobs 10000] [--points 1000000] [--concurrency 32] [--seconds 10]

It makes a throw-away database (dropped at the end), serves `torchyard api` on a free
loopback port in its own process, and drives it from a second process with keep-alive
HTTP/1.1 connections (asyncio streams: little client CPU). Loopback only; every loop is
bounded in time and count. Goals: >= 1000 req/s with p99 <= 50 ms; curve <= 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, insert, text  # noqa: E402

from torchyard.store.auth import create_token  # noqa: E402
from torchyard.store.db import dispose_engines, session_scope  # noqa: E402
from torchyard.store.metrics import query_series, rebuild_blocks  # noqa: E402
from torchyard.store.migrate import upgrade  # noqa: E402
from torchyard.store.models import Attempt, Job, JobEvent, utcnow  # noqa: E402

SPEC = {
    "model": {"name": "mlp", "hidden": [128]},
    "data": {"name": "digits", "val_fraction": 0.2},
    "optimizer": {"name": "sgd", "lr": 0.01},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def populate(url: str, n_jobs: int, n_points: int) -> tuple[str, list[str], str]:
    from torchyard.trainer.spec import parse_spec, spec_to_dict

    spec = spec_to_dict(parse_spec(SPEC))
    with session_scope(url) as s:
        token = create_token(s, "bench")
        uid = s.execute(text("SELECT id FROM users WHERE name = 'bench'")).scalar_one()
    ids = [uuid.uuid4().hex for _ in range(n_jobs)]
    now = utcnow()
    rows = [
        {
            "id": i, "owner_id": uid, "name": f"bench-{k}", "spec": spec, "world_size": 1,
            "priority": 0, "max_restarts": 2, "state": "running", "attempt": 1,
            "cancel_requested": False, "created_at": now, "updated_at": now, "started_at": now,
            "progress": {"step": 10, "total_steps": 100, "epoch": 0.5, "samples_per_s": 1e4, "eta_s": 9.0},
        }
        for k, i in enumerate(ids)
    ]  # fmt: skip
    with session_scope(url) as s:
        s.execute(insert(Job), rows)
        s.execute(
            insert(Attempt),
            [{"job_id": i, "number": 1, "state": "running", "created_at": now} for i in ids],
        )
        s.execute(
            insert(JobEvent),
            [
                {"job_id": i, "type": "state", "data": {"to": "running"}, "created_at": now}
                for i in ids
            ],
        )
    curve_job = ids[0]
    t = time.perf_counter()
    with session_scope(url) as s:
        # Bulk load (generate_series), then the rollups, as a backfill would.
        s.execute(
            text(
                "INSERT INTO metrics (job_id, name, step, epoch, value, time) "
                "SELECT :job, 'train/loss', g, g / 1000.0, 2.0 / (1 + g / 1000.0) + random() / 10, 0 "
                "FROM generate_series(0, :n - 1) g"
            ),
            {"job": curve_job, "n": n_points},
        )
        s.execute(
            text("UPDATE metrics SET value = 50 WHERE job_id = :job AND step = :n / 3"),
            {"job": curve_job, "n": n_points},
        )
        # a few points for every other job, so latest_metrics has work to do
        s.execute(
            text(
                "INSERT INTO metrics (job_id, name, step, epoch, value, time) "
                "SELECT j.id, n.name, 10, 0.5, 0.5, 0 FROM jobs j, "
                "(VALUES ('train/loss'), ('train/lr'), ('val/loss')) AS n(name) WHERE j.id <> :job"
            ),
            {"job": curve_job},
        )
        rebuild_blocks(s, curve_job)
    with create_engine(url, isolation_level="AUTOCOMMIT").connect() as c:
        c.execute(text("VACUUM ANALYZE"))
    print(f"loaded {n_jobs} jobs and a {n_points}-point curve in {time.perf_counter() - t:.1f} s")
    return token, ids, curve_job


async def _client(
    port: int, token: str, ids: list[str], until: float, lat: list[float], errors: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    rnd = random.Random()
    try:
        while time.perf_counter() < until:
            # no ids: the framework floor (/healthz: no auth, no database)
            path = f"/v1/jobs/{rnd.choice(ids)}" if ids else "/healthz"
            req = (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {token}\r\nAccept: application/json\r\n\r\n"
            ).encode()
            t0 = time.perf_counter()
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            if not head.startswith(b"HTTP/1.1 200") or not body.startswith(b"{"):
                errors.append(1)
    finally:
        writer.close()


def load_process(
    port: int, token: str, ids: list[str], conc: int, seconds: float, q: mp.Queue
) -> None:
    async def run() -> tuple[list[float], int, float]:
        # warm-up, not counted
        warm: list[float] = []
        await asyncio.gather(
            *[_client(port, token, ids, time.perf_counter() + 1.5, warm, []) for _ in range(conc)]
        )
        lat: list[float] = []
        errors: list[int] = []
        t0 = time.perf_counter()
        until = t0 + seconds
        await asyncio.gather(*[_client(port, token, ids, until, lat, errors) for _ in range(conc)])
        return lat, len(errors), time.perf_counter() - t0

    q.put(asyncio.run(run()))


def get_json(url: str, token: str) -> tuple[dict, float]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body), time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    name = f"ty_bench_{os.getpid()}"
    admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = args.pg.rsplit("/", 1)[0] + "/" + name
    server = None
    try:
        upgrade(url)
        token, ids, curve_job = populate(url, args.jobs, args.points)
        dispose_engines()
        port = free_port()
        env = {**os.environ, "TORCHYARD_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        env["TORCHYARD_HOME"] = str(Path("/tmp") / f"{name}-home")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchyard",
                "api",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the API did not start") from None
                time.sleep(0.2)

        rates = {}
        for label, targets in (("GET /healthz (floor)", []), ("GET /v1/jobs/{id}", ids)):
            q: mp.Queue = mp.Queue()
            p = mp.Process(
                target=load_process,
                args=(port, token, targets, args.concurrency, args.seconds, q),
            )
            p.start()
            lat, errors, elapsed = q.get(timeout=args.seconds + 120)
            p.join(timeout=30)
            lat.sort()
            pct = lambda f, lat=lat: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000  # noqa: E731
            rates[label] = len(lat) / elapsed
            print(
                f"{label}: {len(lat)} requests in {elapsed:.1f} s at {args.concurrency} "
                f"clients: {len(lat) / elapsed:.0f} req/s, p50 {pct(0.50):.1f} ms, "
                f"p99 {pct(0.99):.1f} ms, max {lat[-1] * 1000:.1f} ms, errors {errors}"
            )
        print(
            "GET /v1/jobs/{id} runs at "
            f"{rates['GET /v1/jobs/{id}'] / rates['GET /healthz (floor)']:.2f} x the floor's rate"
        )

        curve_url = f"{base}/v1/jobs/{curve_job}/metrics?name=train/loss&max_points=1000"
        times = []
        for _ in range(20):
            body, dt = get_json(curve_url, token)
            times.append(dt * 1000)
        loss = body["series"]["train/loss"]
        print(
            f"{args.points}-point curve, max_points=1000, over HTTP: {len(loss['steps'])} points, "
            f"median {statistics.median(times):.1f} ms, max {max(times):.1f} ms "
            f"(spike kept: max {max(loss['max']):.0f})"
        )
        with session_scope(url) as s:
            store_times = []
            for _ in range(10):
                t = time.perf_counter()
                query_series(s, curve_job, names=["train/loss"], max_points=1000)
                store_times.append((time.perf_counter() - t) * 1000)
        print(f"  the store query alone: median {statistics.median(store_times):.1f} ms")
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        dispose_engines()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    sys.exit(main())
