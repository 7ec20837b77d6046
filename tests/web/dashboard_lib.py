"""What the dashboard's browser tests share besides fixtures: an API-only server, tokens,
logging a page in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from support.worker_cluster import ROOT, Cluster, wait_for

T = TypeVar("T")
# A module's world runs on SQLite: a page's subject is rendering over the REST answers, whose
# SQL the API's own tests run on both databases. BOTH (PostgreSQL too) is for a page whose
# subject is the database, listed with why in tests/BACKENDS.md.
SQLITE = "sqlite"
POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)
BOTH = [SQLITE, POSTGRES]


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


def backend_world(
    request: Any, tmp_path_factory: Any, name: str, make: Callable[[Cluster], T]
) -> Iterator[T]:
    """A module's world on its database backend (request.param: sqlite, or postgres, a fresh
    database on the shared server dropped after): an API over a cluster, seeded by `make`."""
    url = None
    if request.param == "postgres":
        from support.db import drop_pg_databases, new_pg_database

        new_db = new_pg_database(request.getfixturevalue("pg_url"))
        request.addfinalizer(lambda: drop_pg_databases(new_db))
        url = new_db()
    c = Cluster(tmp_path_factory.mktemp(f"{name}-{request.param}"), database_url=url)
    try:
        start_api(c)
        yield make(c)
    finally:
        c.stop()
