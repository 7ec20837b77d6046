"""API benchmark on PostgreSQL: GET /v1/jobs/{id} throughput and latency at 32 concurrent
clients against one uvicorn process, and a 1,000,000-point loss curve fetched with
max_points=1000.

    .venv/bin/python bench/api_bench.py [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
        [--jobs 10000] [--points 1000000] [--concurrency 32] [--seconds 12] [--rounds 3]

It makes a throw-away database (dropped at the end), serves `torchyard api` on a free
loopback port in its own process, and drives it from a second process with keep-alive
HTTP/1.1 connections (asyncio streams: little client CPU). Loopback only; every loop is
bounded in time and count. The floor and the polls take turns (--rounds), so the
machine's drift lands on both. A third kind of run polls 8 x concurrency jobs with
If-None-Match (the ETags its warm-up collected), so unchanged jobs answer 304. Goals: GET /v1/jobs/{id} at
>= 0.3 x the /healthz floor of the same run with p99 <= 50 ms; curve <= 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter

from benchlib import scratch_postgres, start_api
from sqlalchemy import create_engine, insert, text

from torchyard.store.auth import create_token
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.metrics import query_series, rebuild_blocks
from torchyard.store.models import Attempt, Job, JobEvent, utcnow

SPEC = {
    "model": {"name": "mlp", "hidden": [128]},
    "data": {"name": "digits", "val_fraction": 0.2},
    "optimizer": {"name": "sgd", "lr": 0.01},
}


def _insert_jobs(url: str, n_jobs: int) -> tuple[str, list[str]]:
    """A user with a token and `n_jobs` running jobs, each with one attempt and event."""
    from torchyard.contracts.spec import parse_spec, spec_to_dict

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
    return token, ids


def _insert_metrics(url: str, curve_job: str, n_points: int) -> None:
    """An `n_points` curve with one spike for `curve_job`, three points for every other."""
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


def populate(url: str, n_jobs: int, n_points: int) -> tuple[str, list[str], str]:
    t = time.perf_counter()
    token, ids = _insert_jobs(url, n_jobs)
    curve_job = ids[0]
    _insert_metrics(url, curve_job, n_points)
    with create_engine(url, isolation_level="AUTOCOMMIT").connect() as c:
        c.execute(text("VACUUM ANALYZE"))
    print(f"loaded {n_jobs} jobs and a {n_points}-point curve in {time.perf_counter() - t:.1f} s")
    return token, ids, curve_job


async def _client(
    port: int,
    token: str,
    ids: list[str],
    until: float,
    lat: list[float],
    codes: Counter[str],
    etags: dict[str, str] | None = None,
) -> None:
    """One keep-alive connection polling random jobs until `until`. With `etags`: a
    client that sends back each job's ETag (If-None-Match), so unchanged polls are 304."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    rnd = random.Random()
    try:
        while time.perf_counter() < until:
            # no ids: the framework floor (/healthz: no auth, no database)
            job = rnd.choice(ids) if ids else None
            path = f"/v1/jobs/{job}" if job else "/healthz"
            tag = etags.get(path) if etags is not None else None
            cond = f"If-None-Match: {tag}\r\n" if tag else ""
            req = (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{cond}"
                f"Authorization: Bearer {token}\r\nAccept: application/json\r\n\r\n"
            ).encode()
            t0 = time.perf_counter()
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                low = line.lower()
                if low.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                elif low.startswith(b"etag:") and etags is not None:
                    etags[path] = line.split(b":", 1)[1].strip().decode()
            body = await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            if head.startswith(b"HTTP/1.1 200") and body.startswith(b"{"):
                codes["200"] += 1
            elif tag and head.startswith(b"HTTP/1.1 304"):
                codes["304"] += 1
            else:
                codes["error"] += 1
    finally:
        writer.close()


def load_process(
    port: int,
    token: str,
    ids: list[str],
    conc: int,
    seconds: float,
    conditional: bool,
    q: mp.Queue,
) -> None:
    async def run() -> tuple[list[float], Counter[str], float]:
        # warm-up, not counted (conditional: it also collects the jobs' ETags)
        etags: dict[str, str] | None = {} if conditional else None
        until = time.perf_counter() + 1.5
        await asyncio.gather(
            *[_client(port, token, ids, until, [], Counter(), etags) for _ in range(conc)]
        )
        lat: list[float] = []
        codes: Counter[str] = Counter()
        t0 = time.perf_counter()
        until = t0 + seconds
        await asyncio.gather(
            *[_client(port, token, ids, until, lat, codes, etags) for _ in range(conc)]
        )
        return lat, codes, time.perf_counter() - t0

    q.put(asyncio.run(run()))


def get_json(url: str, token: str) -> tuple[dict, float]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body), time.perf_counter() - t


def _load(
    port: int, token: str, ids: list[str], args: argparse.Namespace, cond: bool, seconds: float
) -> tuple[list[float], Counter[str], float]:
    """One load run in its own process: (latencies, status counts, seconds)."""
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=load_process, args=(port, token, ids, args.concurrency, seconds, cond, q))
    p.start()
    lat, codes, elapsed = q.get(timeout=seconds + 120)
    p.join(timeout=30)
    return lat, codes, elapsed


def _summary(lat: list[float], codes: Counter[str], elapsed: float, conc: int) -> str:
    lat = sorted(lat)
    pct = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000  # noqa: E731
    return (
        f"{len(lat)} requests in {elapsed:.1f} s at {conc} clients: {len(lat) / elapsed:.0f} "
        f"req/s, p50 {pct(0.50):.1f} ms, p99 {pct(0.99):.1f} ms, max {lat[-1] * 1000:.1f} ms, "
        f"errors {codes['error']}" + (f", 304s {codes['304']}" if codes["304"] else "")
    )


def _polls(port: int, token: str, ids: list[str], args: argparse.Namespace) -> None:
    """The floor and the job polls take turns, `--rounds` times, each run a share of
    `--seconds`: this machine's speed drifts by tens of percent over a minute, and runs
    one after the other would put that drift into the ratio."""
    runs = (
        ("GET /healthz (floor)", [], False),
        ("GET /v1/jobs/{id}", ids, False),
        # clients that each poll their jobs, sending back the ETags they were given
        (
            f"GET /v1/jobs/{{id}} If-None-Match, {8 * args.concurrency} jobs",
            ids[: 8 * args.concurrency],
            True,
        ),
    )
    totals = {label: ([], Counter(), 0.0) for label, _, _ in runs}
    for _ in range(args.rounds):
        for label, targets, cond in runs:
            lat, codes, elapsed = _load(
                port, token, targets, args, cond, args.seconds / args.rounds
            )
            all_lat, all_codes, spent = totals[label]
            all_lat.extend(lat)
            all_codes.update(codes)
            totals[label] = (all_lat, all_codes, spent + elapsed)
    rates = {}
    for label, (lat, codes, elapsed) in totals.items():
        rates[label] = len(lat) / elapsed
        print(f"{label}: {_summary(lat, codes, elapsed, args.concurrency)}")
    floor = rates["GET /healthz (floor)"]
    for label, _, _ in runs[1:]:
        print(f"{label} runs at {rates[label] / floor:.2f} x the floor's rate")


def _curve(base: str, url: str, token: str, curve_job: str, n_points: int) -> None:
    curve_url = f"{base}/v1/jobs/{curve_job}/metrics?name=train/loss&max_points=1000"
    times = []
    for _ in range(20):
        body, dt = get_json(curve_url, token)
        times.append(dt * 1000)
    loss = body["series"]["train/loss"]
    print(
        f"{n_points}-point curve, max_points=1000, over HTTP: {len(loss['steps'])} points, "
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=12.0, help="per kind of request")
    ap.add_argument("--rounds", type=int, default=3, help="turns the kinds take")
    args = ap.parse_args()

    with scratch_postgres(args.pg, f"ty_bench_{os.getpid()}") as url:
        token, ids, curve_job = populate(url, args.jobs, args.points)
        dispose_engines()
        home = f"/tmp/ty_bench_{os.getpid()}-home"
        server, base = start_api({"TORCHYARD_DATABASE_URL": url, "TORCHYARD_HOME": home})
        try:
            _polls(int(base.rsplit(":", 1)[1]), token, ids, args)
            _curve(base, url, token, curve_job, args.points)
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
