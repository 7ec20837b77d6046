"""What the dashboard's browser tests share besides fixtures: an API-only server, tokens,
logging a page in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker"))

from worker_cluster import ROOT, Cluster, wait_for


def start_api(c: Cluster) -> Cluster:
    """Only the API of a cluster (no scheduler, no workers): jobs stay where tests put
    them. Its admin token is `c.token`."""
    subprocess.run([sys.executable, "-m", "torchyard", "db", "upgrade"], cwd=ROOT, env=c.env, check=True)  # fmt: skip
    from torchyard.store.auth import create_token

    with c.session() as s:
        c.token = create_token(s, "tester", admin=True)
    c._spawn("api", ["api", "--host", "127.0.0.1", "--port", str(c.port)])
    wait_for(lambda: c.http.get("/healthz").status_code == 200, 60, "the API")
    return c


def token_for(c: Cluster, user: str, **kw: Any) -> str:
    from torchyard.store.auth import create_token

    with c.session() as s:
        return create_token(s, user, **kw)


def login(page: Any, base: str, token: str, path: str = "/") -> None:
    page.goto(base + path)
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_selector("body[data-user]")
