"""Conditional polls: GET /v1/jobs/{id} and /metrics carry a strong ETag that changes
with every write to the job or its metrics; an unchanged poll is 304 after one read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event, update
from support.db import Factory

from torchyard.store.asyncreads import _compiled
from torchyard.store.db import session_scope
from torchyard.store.jobs import bump_version
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import Job
from torchyard.store.states import RUNNING


@contextmanager
def _statements(app: Any) -> Iterator[list[str]]:
    """The SQL queries (SQLite's BEGIN aside) the API's read sessions and, on PostgreSQL,
    its async reads (store/asyncreads.py) run meanwhile."""
    engine = app.state.read_sessions.kw["bind"]
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.split()[0].upper() not in ("BEGIN", "COMMIT", "ROLLBACK"):
            seen.append(statement)

    reads = app.state.async_reads
    if reads is not None:
        run = reads._row

        async def recorded(which: str, viewer: Any, job_id: str) -> Any:
            seen.append(_compiled(which, viewer.is_admin).sql)
            return await run(which, viewer, job_id)

        reads._row = recorded
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)
        if reads is not None:
            del reads._row


def _ingest(db_url: str, job_id: str, step: int) -> None:
    # What the worker's batch writer does: metrics and a version bump, one transaction.
    with session_scope(db_url) as s:
        ingest_metrics(s, job_id, [{"name": "train/loss", "step": step, "value": 1.0, "time": 0}])
        bump_version(s, job_id)


def test_unchanged_job_is_304_after_one_read(
    client: TestClient, app: Any, factory: Factory, alice: dict[str, str]
) -> None:
    job_id = factory.job("alice", state=RUNNING)
    first = client.get(f"/v1/jobs/{job_id}", headers=alice)
    tag = first.headers["etag"]
    assert tag.startswith('"') and not tag.startswith("W/")  # strong
    assert first.headers["cache-control"] == "no-cache"
    with _statements(app) as seen:
        r = client.get(f"/v1/jobs/{job_id}", headers=alice | {"If-None-Match": tag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == tag
    assert len(seen) == 1 and "version" in seen[0]  # the token is cached: one read only
    # any of a list, and a weak spelling of it, match (RFC 9110's weak comparison)
    assert (
        client.get(
            f"/v1/jobs/{job_id}", headers=alice | {"If-None-Match": f'"x", W/{tag}'}
        ).status_code
        == 304
    )
    stale = client.get(f"/v1/jobs/{job_id}", headers=alice | {"If-None-Match": '"other"'})
    assert stale.status_code == 200 and stale.json() == first.json()
    assert stale.headers["etag"] == tag


def test_every_write_changes_the_etag(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job_id = factory.job("alice")
    url = f"/v1/jobs/{job_id}"
    tags = [client.get(url, headers=alice).headers["etag"]]
    factory.set_state(job_id, "starting", attempt=1)  # a transition (Core UPDATE)
    tags.append(client.get(url, headers=alice).headers["etag"])
    with session_scope(db_url) as s:  # the worker's progress UPDATE (no version in it)
        s.execute(update(Job).where(Job.id == job_id).values(progress={"step": 1}))
    r = client.get(url, headers=alice | {"If-None-Match": tags[-1]})
    assert r.status_code == 200 and r.json()["progress"]["step"] == 1
    tags.append(r.headers["etag"])
    _ingest(db_url, job_id, 5)  # metrics only
    r = client.get(url, headers=alice | {"If-None-Match": tags[-1]})
    assert r.status_code == 200, "a changed job must not be 304"
    assert r.json()["latest_metrics"] == {"train/loss": {"step": 5, "value": 1.0}}
    tags.append(r.headers["etag"])
    assert len(set(tags)) == 4
    assert client.get(url, headers=alice | {"If-None-Match": tags[-1]}).status_code == 304


def test_etag_is_the_same_for_every_viewer_and_404_stays_404(
    client: TestClient, factory: Factory, alice: dict[str, str], bob: dict[str, str],
    admin: dict[str, str],
) -> None:  # fmt: skip
    job_id = factory.job("alice")
    mine = client.get(f"/v1/jobs/{job_id}", headers=alice)
    theirs = client.get(f"/v1/jobs/{job_id}", headers=admin)
    assert mine.headers["etag"] == theirs.headers["etag"] and mine.json() == theirs.json()
    tag = mine.headers["etag"]
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/metrics"):
        assert client.get(path, headers=bob | {"If-None-Match": tag}).status_code == 404
        assert client.get(path, headers=bob | {"If-None-Match": "*"}).status_code == 404


def test_metrics_etag_covers_the_query_and_new_points(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job_id = factory.job("alice", state=RUNNING)
    _ingest(db_url, job_id, 1)
    url = f"/v1/jobs/{job_id}/metrics"
    queries: list[dict[str, Any]] = [
        {}, {"name": "train/loss"}, {"after_step": 0}, {"max_points": 10},
        {"name": "train/loss", "max_points": 10},
    ]  # fmt: skip
    tags = [client.get(url, params=q, headers=alice).headers["etag"] for q in queries]
    assert len(set(tags)) == len(queries)
    for q, tag in zip(queries, tags, strict=True):
        r = client.get(url, params=q, headers=alice | {"If-None-Match": tag})
        assert r.status_code == 304 and r.headers["cache-control"] == "no-cache"
    _ingest(db_url, job_id, 2)
    r = client.get(url, headers=alice | {"If-None-Match": tags[0]})
    assert r.status_code == 200 and r.json()["series"]["train/loss"]["steps"] == [1, 2]
    assert r.headers["etag"] not in tags
