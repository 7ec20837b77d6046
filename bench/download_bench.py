"""Checkpoint download benchmark: a 1 GiB checkpoint over loopback from a real uvicorn
server, whole and as one byte range.

    .venv/bin/python bench/download_bench.py [--gib 1] [--random] [--repeat 3]

It makes a temp dir (SQLite store, storage root, the file: sparse by default, --random
writes random bytes), registers the file as a checkpoint of a running job, serves
`torchyard api` in its own process on a free loopback port, and downloads it with httpx
streaming (and with a plain socket client, to tell the client's cost from the server's).
Prints GB/s (10^9 bytes/s), best of --repeat, for the full download and for a 512 MiB
range. Everything is removed at the end. Goal: >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from benchlib import STORE_SPEC, start_api

from torchyard.store.auth import create_token, get_or_create_user
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import dispose_engines, session_scope
from torchyard.store.jobs import create_job
from torchyard.store.migrate import upgrade
from torchyard.store.paths import job_dir
from torchyard.store.states import RUNNING, STARTING, transition

MIB = 1 << 20
REL = "checkpoints/step-00000001.pt"


def make_checkpoint(url: str, storage: Path, size: int, random_bytes: bool) -> tuple[str, str, int]:
    """(job id, token, checkpoint id) of a running job with a `size`-byte checkpoint."""
    with session_scope(url) as s:
        token = create_token(s, "bench")
        job, _ = create_job(s, get_or_create_user(s, "bench").id, dict(STORE_SPEC), name="dl")
        for to in (STARTING, RUNNING):
            transition(s, job, to, reason="bench")
        job_id = job.id
    path = job_dir(storage, job_id) / REL
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        if random_bytes:
            block = os.urandom(64 * MIB)
            for _ in range(size // len(block)):
                f.write(block)
            f.write(block[: size % len(block)])
        else:
            f.truncate(size)  # sparse: reads cost no disk, so the HTTP path is measured
    with session_scope(url) as s:
        row = record_checkpoint(
            s, job_id, attempt=1, step=1, epoch=0.0, path=REL, bytes=size, sha256="b" * 64
        )  # the bench does not check the content: a fixed sha256 (the ETag) will do
        return job_id, token, row.id


def httpx_get(url: str, headers: dict[str, str]) -> tuple[int, int]:
    """(status, bytes) of a streamed GET with httpx."""
    n = 0
    with httpx.Client(timeout=60) as c, c.stream("GET", url, headers=headers) as r:
        for chunk in r.iter_raw(4 * MIB):
            n += len(chunk)
        return r.status_code, n


def socket_get(url: str, headers: dict[str, str]) -> tuple[int, int]:
    """(status, bytes) of a GET read with recv_into: no client-side parsing per chunk."""
    u = httpx.URL(url)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((u.host, u.port)) as s:
        s.sendall(f"GET {u.raw_path.decode()} HTTP/1.1\r\nHost: b\r\n{extra}\r\n".encode())
        buf = bytearray(4 * MIB)
        view = memoryview(buf)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)
        header, _, body = head.partition(b"\r\n\r\n")
        status = int(header.split()[1])
        length = next(
            int(line.split(b":")[1])
            for line in header.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        n = len(body)
        while n < length:
            got = s.recv_into(view)
            if not got:
                break
            n += got
        return status, n


def timed(
    get: Callable[[str, dict[str, str]], tuple[int, int]],
    url: str,
    headers: dict[str, str],
    want: tuple[int, int],
    repeat: int,
) -> float:
    """Best GB/s of `repeat` downloads (each checked: status and byte count)."""
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        got = get(url, headers)
        dt = time.perf_counter() - t
        if got != want:
            raise SystemExit(f"download of {url} gave (status, bytes) {got}, not {want}")
        best = max(best, want[1] / dt / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB")
    ap.add_argument("--random", action="store_true", help="random bytes, not a sparse file")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.gib <= 0 or args.repeat < 1:
        ap.error("--gib and --repeat must be positive")
    size = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory() as d:
        home, storage = Path(d) / "home", Path(d) / "storage"
        url = f"sqlite:///{d}/bench.db"
        upgrade(url)
        job_id, token, cid = make_checkpoint(url, storage, size, args.random)
        dispose_engines()
        server, base = start_api(
            {
                "TORCHYARD_DATABASE_URL": url,
                "TORCHYARD_HOME": str(home),
                "TORCHYARD_STORAGE_ROOT": str(storage),
            }
        )
        try:
            dl = f"{base}/v1/jobs/{job_id}/checkpoints/{cid}/download"
            auth = {"Authorization": f"Bearer {token}"}
            first, last = size // 4, size // 4 + 512 * MIB - 1
            ranged = {**auth, "Range": f"bytes={first}-{min(last, size - 1)}"}
            part = min(last, size - 1) - first + 1
            kind = "random" if args.random else "sparse"
            print(f"file: {size / (1 << 30):.2f} GiB ({kind}), best of {args.repeat}")
            for name, get in (("httpx streaming", httpx_get), ("socket recv_into", socket_get)):
                full = timed(get, dl, auth, (200, size), args.repeat)
                rng = timed(get, dl, ranged, (206, part), args.repeat)
                print(f"{name}: full {full:.2f} GB/s, range of {part / MIB:.0f} MiB {rng:.2f} GB/s")
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
