"""Another host's upgrade, seen by a running cluster (store/migrate.py `start_schema_watch`):
once the database is at a revision this code does not know, the api, the scheduler and the
worker each stop as on SIGTERM, the worker handing its running job back (checkpoint first,
not counted). Restarted on code that knows the schema, the job resumes and succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
from specs import digits_spec
from sqlalchemy import select, text
from support.worker_cluster import Cluster, checkpointed_and_running, wait_for

from torchyard.store.migrate import head

pytestmark = pytest.mark.e2e

# batches of 32, 150 epochs: still training well after its first checkpoint.
SPEC = digits_spec(
    batch_size=32,
    epochs=150,
    checkpoint={"every_steps": 200, "every_epochs": None, "keep_last": 2},
    log_every_steps=10,
    max_restarts=0,  # a counted failure would fail the job: the stop must hand it back
    seed=4,
)
NEWER = "9999_from_the_future"


def _stamp(c: Cluster, revision: str) -> None:
    with c.session() as s:
        s.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})


def test_a_newer_schema_stops_every_service_and_the_job_is_handed_back(tmp_path: Path) -> None:
    from torchyard.store.models import Attempt, Job

    c = Cluster(tmp_path, extra_env={"TORCHYARD_SCHEMA_WATCH_S": "0.5"})
    try:
        c.start(workers=1)
        job = c.submit(SPEC)
        wait_for(lambda: checkpointed_and_running(c, job["id"], 200), 120, "a first checkpoint")
        _stamp(c, NEWER)  # what another host's `torchyard db upgrade` of a newer release does
        for name, p in c.procs.items():
            p.wait(timeout=90)
            assert f"schema revision {NEWER}" in c.log_of(name), name
        assert c.procs["w0"].returncode == 0  # a warm shutdown, as on SIGTERM
        with c.session() as s:
            state = s.scalar(select(Job.state).where(Job.id == job["id"]))
            first = s.scalars(select(Attempt).where(Attempt.job_id == job["id"])).one()
            assert (state, first.state, first.exit_code) == ("queued", "handed_back", 75)
        _stamp(c, head())  # the new release's code, as far as this test goes
        c.procs.clear()
        c.start(workers=1)
        done = c.wait_state(job["id"], "succeeded", timeout=180)
        assert [a["state"] for a in done["attempts"]] == ["handed_back", "succeeded"]
        with c.session() as s:
            second = s.scalars(
                select(Attempt).where(Attempt.job_id == job["id"], Attempt.number == 2)
            ).one()
            assert second.resumed_from  # from the checkpoint the stop wrote
    finally:
        c.stop()
