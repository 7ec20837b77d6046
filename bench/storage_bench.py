"""Object-storage transfer benchmark: storage/s3.py's own multipart upload and ranged
download against boto3's `upload_file` / `download_file` (its default TransferConfig), side
by side on one real SeaweedFS over loopback (tests/seaweed.py starts it).

    .venv/bin/python bench/storage_bench.py [--size BYTES] [--repeat 3]
        [--part-mib 64] [--concurrency 8]

It writes a file of --size random bytes (default 1 GiB), then, --repeat times (best of),
uploads it with boto3 and with `S3Storage.write_file(…, sha256=…)`, and downloads each with
boto3 and with `S3Storage.local_copy` (its cache cleared each time; the copy is checked
against the stored sha256). Prints MB/s (10^6 bytes/s) for each and the ratios
torchyard/boto3. Goal: both ratios >= 0.8. Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from benchlib import make_file  # noqa: E402
from seaweed import start_seaweed  # noqa: E402

from torchyard.storage.s3 import S3Storage  # noqa: E402

MIB = 1 << 20


def best(repeat: int, run: Callable[[], None], before: Callable[[], None]) -> float:
    """The fastest of `repeat` runs, in seconds (`before` each, untimed)."""
    times = []
    for _ in range(repeat):
        before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    server = start_seaweed(work, volume_mb=1024, volumes=64)
    try:
        os.environ.update(server.env())
        bucket = server.make_bucket("bench")
        src = work / "src.bin"
        sha = make_file(src, args.size)
        client = server.client()  # boto3's defaults, path-style for SeaweedFS
        cache = work / "cache"
        ours = S3Storage(bucket, "ty", cache=cache, endpoint_url=server.endpoint_url,
                         part_bytes=args.part_mib * MIB, concurrency=args.concurrency)  # fmt: skip
        dst = work / "boto3-download.bin"
        key = "bench/object.bin"

        def nothing() -> None:
            pass

        def clear() -> None:
            dst.unlink(missing_ok=True)
            shutil.rmtree(cache, ignore_errors=True)

        def ours_copy() -> None:
            got = ours.local_copy(key)
            assert got.stat().st_size == args.size

        up_boto = best(args.repeat, lambda: client.upload_file(str(src), bucket, "boto3/" + key), nothing)  # fmt: skip
        up_ours = best(args.repeat, lambda: ours.write_file(key, src, sha256=sha) and None, nothing)  # fmt: skip
        down_boto = best(args.repeat, lambda: client.download_file(bucket, "boto3/" + key, str(dst)), clear)  # fmt: skip
        down_ours = best(args.repeat, ours_copy, clear)
        mb = args.size / 1e6
        print(f"size {args.size} bytes, best of {args.repeat}, part {args.part_mib} MiB, "
              f"concurrency {args.concurrency}, {os.cpu_count()} cores")  # fmt: skip
        print(f"upload    boto3 upload_file    {mb / up_boto:8.1f} MB/s")
        print(f"upload    S3Storage.write_file {mb / up_ours:8.1f} MB/s   ratio {up_boto / up_ours:.2f}")  # fmt: skip
        print(f"download  boto3 download_file  {mb / down_boto:8.1f} MB/s")
        print(f"download  S3Storage.local_copy {mb / down_ours:8.1f} MB/s   ratio {down_boto / down_ours:.2f}")  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
