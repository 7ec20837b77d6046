"""What the benches share: the repository root and tests/ on sys.path, tiny specs, percentiles, a
throw-away PostgreSQL database and `torchyard api` started as a process on a free port."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The repository root, then tests/ (the helpers a bench shares with the tests, imported as
# `support.…`, `seaweed`), as pyproject's pytest pythonpath has them.
for _path in (ROOT / "tests", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from sqlalchemy import create_engine, text  # noqa: E402

from torchyard.store.db import dispose_engines  # noqa: E402
from torchyard.store.migrate import upgrade  # noqa: E402

# A job the store accepts but no bench trains (rows for the API, the scheduler, downloads).
STORE_SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [16]},
    "data": {"name": "synthetic", "shape": [1, 8, 8], "num_classes": 4, "size": 64},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "epochs": 1,
}
# A job a worker trains in well under a second: digits, a small MLP, a few steps.
TINY: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "digits"},
    "optimizer": {"name": "sgd"},
    "batch_size": 64,
    "epochs": 1,
    "max_steps": 10,
    "log_every_steps": 1,
}


def sandbox_line() -> str:
    """How this host's workers confine trainers, for a bench's output: without bubblewrap
    a slot's warm trainer is a one-shot standby, not a zygote, so start times and
    worker-seconds are not those of a sandboxed pool (a fresh machine here lacks it until
    scripts/test.sh installs it)."""
    from torchyard.worker.sandbox import support

    ok = support()
    if ok.ok:
        return "trainers sandboxed (bubblewrap): a slot's warm trainer is a zygote"
    return (
        f"NOTE: trainers run unsandboxed here ({ok.why}): a slot's warm trainer is a "
        "one-shot standby, not a zygote, so most jobs start cold (~5 s on 2 cores); these "
        "figures are not a sandboxed pool's"
    )


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def scratch_postgres(admin_url: str, name: str) -> Iterator[str]:
    """A new, migrated database `name` beside `admin_url`'s, dropped afterwards: its URL."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade(url)
        yield url
    finally:
        dispose_engines()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def start_api(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """`torchyard api` with `env` over ours on a free loopback port, once /healthz answers:
    (process, base URL)."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    argv = [sys.executable, "-m", "torchyard", "api", "--port", str(port)]
    server = subprocess.Popen([*argv, "--log-level", "warning"], cwd=ROOT, env=full_env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(base + "/healthz", timeout=1).read()
            return server, base
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise SystemExit("the API did not start") from None
            time.sleep(0.2)


def make_file(path: Path, size: int) -> str:
    """`size` random bytes at `path` (written in 16 MiB blocks); their sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 16 << 20))
            h.update(block)
            f.write(block)
            left -= len(block)
    return h.hexdigest()
