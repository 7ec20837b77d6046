"""A worker started while PostgreSQL is down (a host booting during an outage) waits for
the database and registers once it is back, rather than exiting and leaving its GPU idle.
Uses a private PostgreSQL (initdb/pg_ctl), never the shared one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support.services import PrivatePostgres, pg_bin
from support.worker_cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def test_a_worker_started_during_a_database_outage_registers_when_it_returns(
    tmp_path: Path,
) -> None:
    if pg_bin() is None:
        msg = "needs initdb/pg_ctl (a PostgreSQL server)"
        pytest.fail(msg, pytrace=False) if IN_CI else pytest.skip(msg)
    pg = PrivatePostgres()
    pg.start()
    c = Cluster(tmp_path, database_url=pg.url())
    try:
        c.start(workers=0)  # the API and the scheduler, the schema in place
        pg.stop()
        worker = c.start_worker("w0")
        time.sleep(4)  # registration fails and is retried meanwhile
        assert worker.poll() is None, "the worker exited instead of waiting for the database"
        pg.start()
        (w,) = c.wait_workers(1, timeout=60)
        assert w["id"] == "w0"
    finally:
        c.stop()
        pg.destroy()
