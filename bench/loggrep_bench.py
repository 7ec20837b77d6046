"""The log search's speed (api/loggrep.py): MB/s of `grep_log` over a synthetic training log
(~200 MB by default) written to a temporary folder and read through the local storage
backend's `read_range`, as the route reads it; the page cache is warm after the first
round, so this is the search's CPU cost, not the disk's.

    .venv/bin/python bench/loggrep_bench.py [--mb 200] [--rounds 3]

Cases: a rare match (case as written, then ignore_case), a frequent one (one line in 100,
answer limits followed page by page), a non-ASCII ignore_case pattern (the line-by-line
path). Each case scans the whole log, following `next_offset` across requests of the
default budget (64 MiB), and prints the best round's MB/s."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from torchyard.api.loggrep import grep_log
from torchyard.settings import Settings
from torchyard.storage import job_key, storage_for

JOB = "0" * 32


def write_log(root: Path, mb: int) -> int:
    path = root / "jobs" / JOB / "output.log"
    path.parent.mkdir(parents=True)
    line = "step {:>9} epoch {:>4} train/loss {:.6f} lr 0.001000 samples/s 51234.5{}\n"
    size, i = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1_000_000:
            block = "".join(
                line.format(k, k // 1000, 1 / (k + 1), " WARN slow" if k % 100 == 7 else "")
                + ("RuntimeError: CUDA out of memory\n" if k % 250_000 == 3 else "")
                for k in range(i, i + 10_000)
            )
            f.write(block)
            size += len(block)
            i += 10_000
    return path.stat().st_size


def search(read, pattern: str, ignore_case: bool) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    offset, found, requests = 0, 0, 0
    while True:
        r = grep_log(read, pattern, ignore_case=ignore_case, offset=offset, limit_matches=1000)
        found += len(r.matches)
        requests += 1
        if r.complete:
            return found, requests
        offset = r.next_offset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = Settings(_env_file=None, storage_root=root, home=root / "home")  # type: ignore[call-arg]
        size = write_log(root, args.mb)
        storage = storage_for(settings)
        key = job_key(JOB, "output.log")

        def read(start: int, n: int) -> tuple[bytes, int]:
            return storage.read_range(key, start, n)

        print(f"log: {size / 1e6:.0f} MB; best of {args.rounds} rounds")
        cases = [
            ("rare, exact", "CUDA out of memory", False),
            ("rare, ignore_case", "cuda OUT of memory", True),
            ("1 line in 100, exact", "WARN slow", False),
            ("non-ASCII, ignore_case", "ÉPOCH", True),
        ]
        for label, pattern, ic in cases:
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                found, requests = search(read, pattern, ic)
                best = min(best, time.perf_counter() - t0)
            print(
                f"{label:>24}: {size / 1e6 / best:8.0f} MB/s  ({found} matches, {requests} requests)"
            )


if __name__ == "__main__":
    main()
