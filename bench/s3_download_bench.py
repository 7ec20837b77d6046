"""Checkpoint download with an S3 object store: through the API (streamed from the store)
against a direct GET from the store, side by side on one real SeaweedFS over loopback.

    .venv/bin/python bench/s3_download_bench.py [--gib 1] [--repeat 3]

Starts SeaweedFS (tests/seaweed.py), writes --gib GiB of random bytes, uploads them with
`S3Storage.write_file` as a checkpoint of a running job (SQLite store, the row registered
as bench/download_bench.py does), and serves `torchyard api` with
TORCHYARD_STORAGE_URL=s3://… in its own process on a free loopback port, once plain and once
with TORCHYARD_DOWNLOAD_REDIRECT=1. Then, --repeat times each (best of), the whole object:
- direct, httpx: a plain GET of a presigned URL straight from the S3 endpoint (httpx
  streaming, as below: the baseline);
- direct, boto3: `get_object` with its body read in 4 MiB blocks;
- API, streamed: GET /v1/jobs/{id}/checkpoints/{cid}/download, httpx streaming (the API
  reads the object from the store and sends it on);
- API, redirect: the same GET against the redirecting API, the client following the 307
  to the presigned URL.
Every download is checked for its status and byte count. Prints MB/s (10^6 bytes/s) of each
and the ratios API/direct (httpx). Goal: API streamed >= 0.8x direct. Everything is
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import benchlib
import httpx
from seaweed import Seaweed, start_seaweed

from torchyard.storage import job_key
from torchyard.storage.s3 import S3Storage
from torchyard.store.auth import create_token, get_or_create_user
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import upgrade
from torchyard.store.states import RUNNING, STARTING, transition

MIB = 1 << 20
REL = "checkpoints/step-00000001.pt"
BLOCK = 4 * MIB


def make_checkpoint(url: str, store: S3Storage, src: Path, sha: str) -> tuple[str, str, int]:
    """(job id, token, checkpoint id) of a running job whose checkpoint is `src`, uploaded."""
    with session_scope(url) as s:
        token = create_token(s, "bench")
        job, _ = create_job(
            s, get_or_create_user(s, "bench").id, dict(benchlib.STORE_SPEC), name="dl"
        )
        for to in (STARTING, RUNNING):
            transition(s, job, to, reason="bench")
        job_id = job.id
    size = src.stat().st_size
    store.write_file(job_key(job_id, REL), src, sha256=sha)
    with session_scope(url) as s:
        row = record_checkpoint(
            s, job_id, attempt=1, step=1, epoch=0.0, path=REL, bytes=size, sha256=sha
        )
        return job_id, token, row.id


def httpx_get(url: str, headers: dict[str, str]) -> tuple[int, int]:
    """(status, bytes) of a streamed GET with httpx, redirects followed."""
    n = 0
    with (
        httpx.Client(timeout=60, follow_redirects=True) as c,
        c.stream("GET", url, headers=headers) as r,
    ):
        for chunk in r.iter_raw(BLOCK):
            n += len(chunk)
        return r.status_code, n


def socket_get(url: str, headers: dict[str, str]) -> tuple[int, int]:
    """(status, bytes) of a GET read with recv_into (no client-side parsing per chunk, so
    the server's pace is measured), one redirect followed."""
    u = httpx.URL(url)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((u.host, u.port)) as s:
        host = f"{u.host}:{u.port}"
        s.sendall(f"GET {u.raw_path.decode()} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            got = s.recv(65536)
            if not got:
                raise ConnectionError(f"{url}: closed before the headers")
            head += got
        header, _, body = head.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if status in (301, 302, 303, 307, 308):
            return socket_get(fields["location"], {})  # another origin: no Authorization
        length, n = int(fields["content-length"]), len(body)
        view = memoryview(bytearray(BLOCK))
        while n < length:
            got = s.recv_into(view)
            if not got:
                break
            n += got
        return status, n


def best_mb_s(repeat: int, size: int, run: Callable[[], tuple[int, int]]) -> float:
    """The best MB/s of `repeat` runs of `run`, each checked: (200, size)."""
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        got = run()
        dt = time.perf_counter() - t
        if got != (200, size):
            raise SystemExit(f"a download gave (status, bytes) {got}, not {(200, size)}")
        best = max(best, size / dt / 1e6)
    return best


def api_env(server: Seaweed, db: str, home: Path, storage_url: str) -> dict[str, str]:
    return server.env() | {
        "TORCHYARD_DATABASE_URL": db,
        "TORCHYARD_HOME": str(home),
        "TORCHYARD_STORAGE_ROOT": str(home / "cache"),
        "TORCHYARD_STORAGE_URL": storage_url,
        "TORCHYARD_S3_ENDPOINT_URL": server.endpoint_url,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="object size in GiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.gib <= 0 or args.repeat < 1:
        ap.error("--gib and --repeat must be positive")
    return args


def main() -> int:
    args = parse_args()
    size = int(args.gib * (1 << 30))
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="s3-download-bench-"))
    server = start_seaweed(work, volume_mb=1024, volumes=64)
    apis: list[subprocess.Popen[bytes]] = []
    try:
        os.environ.update(server.env())
        bucket = server.make_bucket("bench")
        storage_url = f"s3://{bucket}/ty"
        home = work / "home"
        db = f"sqlite:///{work}/bench.db"
        upgrade(db)
        env = api_env(server, db, home, storage_url)
        store = S3Storage(bucket, "ty", cache=work / "cache", endpoint_url=server.endpoint_url)
        src = work / "checkpoint.bin"
        sha = benchlib.make_file(src, size)
        job_id, token, cid = make_checkpoint(db, store, src, sha)
        src.unlink()
        dispose_engines()
        streamed, base = benchlib.start_api(env)
        apis.append(streamed)
        redirecting, base_r = benchlib.start_api(env | {"TORCHYARD_DOWNLOAD_REDIRECT": "1"})
        apis.append(redirecting)

        path = f"/v1/jobs/{job_id}/checkpoints/{cid}/download"
        auth = {"Authorization": f"Bearer {token}"}
        presigned = store.presign(job_key(job_id, REL), 3600)
        client = server.client()
        name = store.describe(job_key(job_id, REL)).split("/", 3)[3]

        boto3_get = partial(boto3_read, client, bucket, name)
        # the redirecting API answers 307 (the client then GETs the store)
        first = httpx.get(base_r + path, headers=auth, follow_redirects=False)
        if first.status_code != 307:
            raise SystemExit(f"the redirecting API answered {first.status_code}, not 307")
        got: dict[str, dict[str, float]] = {}
        targets = {
            "direct (presigned GET)": (presigned, {}),
            "API, streamed": (base + path, auth),
            "API, 307 redirect": (base_r + path, auth),
        }
        for client_name, get in (("httpx streaming", httpx_get), ("socket recv_into", socket_get)):
            got[client_name] = {
                label: best_mb_s(args.repeat, size, partial(get, url, headers))
                for label, (url, headers) in targets.items()
            }
        boto3_mb_s = best_mb_s(args.repeat, size, boto3_get)
    finally:
        for p in apis:
            p.terminate()
            p.wait(30)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(size, args.repeat, load, got, boto3_mb_s)
    return 0


def boto3_read(client: Any, bucket: str, name: str) -> tuple[int, int]:
    """boto3's own streamed GET of the object: (status, bytes)."""
    r = client.get_object(Bucket=bucket, Key=name)
    n = 0
    while block := r["Body"].read(BLOCK):
        n += len(block)
    return r["ResponseMetadata"]["HTTPStatusCode"], n


def report(
    size: int, repeat: int, load: float, got: dict[str, dict[str, float]], boto3_mb_s: float
) -> None:
    print(f"object {size / (1 << 30):.2f} GiB (random), SeaweedFS over loopback, best of "
          f"{repeat}, {os.cpu_count()} cores, load average {load:.1f} at the start")  # fmt: skip
    for client_name, rows in got.items():
        direct = rows["direct (presigned GET)"]
        for label, mb_s in rows.items():
            ratio = "" if mb_s is direct else f"   ratio API/direct {mb_s / direct:.2f}"
            print(f"{client_name:<17} {label:<23} {mb_s:8.1f} MB/s{ratio}")
    print(f"{'boto3':<17} {'direct (get_object)':<23} {boto3_mb_s:8.1f} MB/s")


if __name__ == "__main__":
    sys.exit(main())
