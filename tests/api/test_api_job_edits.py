"""Organising jobs through HTTP, on each database backend: tags and notes (PATCH), archive,
delete of an ended job (every row and file gone, the audit entry kept), and who may."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from support.db import SPEC, Factory

from torchyard.settings import Settings
from torchyard.storage.memory import MemoryStorage
from torchyard.store.auth import user_named
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope
from torchyard.store.joborg import JobOrgError, delete_files, normalise_tags
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import (
    Assignment,
    Attempt,
    AuditEntry,
    Checkpoint,
    IdempotencyKey,
    Job,
    JobEvent,
    JobTag,
    Metric,
    MetricBlock,
    Sweep,
    SweepTrial,
)
from torchyard.store.paths import LOG_FILE, job_dir
from torchyard.store.projects import create_project, set_member
from torchyard.store.uijobs import changes_since, changes_start

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md

Headers = dict[str, str]


def _error(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    if code:
        assert err["code"] == code
    return err


def _audit(url: str, action: str | None = None) -> list[AuditEntry]:
    with session_scope(url) as s:
        q = select(AuditEntry).order_by(AuditEntry.id)
        if action is not None:
            q = q.where(AuditEntry.action == action)
        rows = list(s.scalars(q))
        s.expunge_all()
        return rows


def _tag_rows(url: str, job_id: str) -> set[str]:
    with session_scope(url) as s:
        return set(s.scalars(select(JobTag.tag).where(JobTag.job_id == job_id)))


# --- tags and notes --------------------------------------------------------------------------------


def test_patch_sets_tags_and_notes_and_moves_the_etag(
    client: TestClient, alice: Headers, factory: Factory
) -> None:
    job = factory.job("alice", "succeeded")
    before = client.get(f"/v1/jobs/{job}", headers=alice)
    r = client.patch(
        f"/v1/jobs/{job}", json={"tags": ["lr:0.1", "b", "lr:0.1"], "notes": "n"}, headers=alice
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tags"] == ["lr:0.1", "b"] and body["notes"] == "n"  # duplicates dropped
    assert r.headers["ETag"] != before.headers["ETag"]
    again = client.get(f"/v1/jobs/{job}", headers=alice)
    assert again.json() == body and again.headers["ETag"] == r.headers["ETag"]
    assert _tag_rows(factory.url, job) == {"lr:0.1", "b"}
    [entry] = _audit(factory.url, "job.update")
    assert entry.target == f"job:{job}" and entry.user_name == "alice"
    assert entry.details == {
        "tags": {"before": [], "after": ["lr:0.1", "b"]},
        "notes": {"before": None, "after": "n"},
    }
    # Only what is given changes; "" clears the notes; the same value again records nothing.
    r = client.patch(f"/v1/jobs/{job}", json={"tags": ["c"]}, headers=alice)
    assert r.json()["tags"] == ["c"] and r.json()["notes"] == "n"
    assert _tag_rows(factory.url, job) == {"c"}
    assert (
        client.patch(f"/v1/jobs/{job}", json={"notes": ""}, headers=alice).json()["notes"] is None
    )
    same = client.patch(f"/v1/jobs/{job}", json={"tags": ["c"]}, headers=alice)
    assert same.headers["ETag"] == client.get(f"/v1/jobs/{job}", headers=alice).headers["ETag"]
    assert len(_audit(factory.url, "job.update")) == 3


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"tags": ["ok", "has space"]}, {"tags.1"}),
        ({"tags": ["ok", 3]}, {"tags.1"}),
        ({"tags": "solo"}, {"tags"}),
        ({"tags": [f"t{i}" for i in range(33)]}, {"tags"}),
        ({"tags": ["x" * 65]}, {"tags.0"}),
        ({"notes": "x" * 10_001}, {"notes"}),
        ({"notes": 5, "colour": "red", "tags": ["é"]}, {"notes", "colour", "tags.0"}),
    ],
)
def test_patch_names_every_bad_field_and_changes_nothing(
    client: TestClient, alice: Headers, factory: Factory, body: dict[str, Any], fields: set[str]
) -> None:
    job = factory.job("alice", "running")
    client.patch(f"/v1/jobs/{job}", json={"tags": ["keep"], "notes": "keep"}, headers=alice)
    etag = client.get(f"/v1/jobs/{job}", headers=alice).headers["ETag"]
    err = _error(client.patch(f"/v1/jobs/{job}", json=body, headers=alice), 422, "validation_error")
    assert {d["field"] for d in err["details"]} == fields
    for f in fields:
        assert f in err["message"]
    after = client.get(f"/v1/jobs/{job}", headers=alice)
    assert after.headers["ETag"] == etag
    assert after.json()["tags"] == ["keep"] and after.json()["notes"] == "keep"
    assert _tag_rows(factory.url, job) == {"keep"}
    assert len(_audit(factory.url, "job.update")) == 1


def test_normalise_tags_is_the_one_rule() -> None:
    assert normalise_tags(["a", "B.c", "a", "x=1+2/y:z_-"]) == ["a", "B.c", "x=1+2/y:z_-"]
    assert normalise_tags(None) == [] and normalise_tags(("t",)) == ["t"]
    assert normalise_tags(["t"] * 40) == ["t"]  # the limit counts distinct tags
    for bad in (["a b"], [""], ["ä"], "a", [None]):
        with pytest.raises(JobOrgError) as e:
            normalise_tags(bad)
        assert isinstance(e.value, ValueError) and e.value.status == 422


def test_an_edit_wakes_the_dashboards_change_feed(
    client: TestClient, alice: Headers, factory: Factory
) -> None:
    job = factory.job("alice", "succeeded")  # ended: its version is no longer watched
    with session_scope(factory.url) as s:
        state = changes_start(s)
    client.patch(f"/v1/jobs/{job}", json={"tags": ["seen"]}, headers=alice)
    with session_scope(factory.url) as s:
        assert job in changes_since(s, state, 0.0)
    client.post(f"/v1/jobs/{job}/archive", headers=alice)
    with session_scope(factory.url) as s:
        assert job in changes_since(s, state, 0.0)


# --- archive ---------------------------------------------------------------------------------------


def test_archive_hides_from_the_default_list_and_unarchive_brings_back(
    client: TestClient, alice: Headers, factory: Factory
) -> None:
    job = factory.job("alice", "running")  # a running job may be archived too
    other = factory.job("alice")
    r = client.post(f"/v1/jobs/{job}/archive", headers=alice)
    assert r.status_code == 200 and r.json()["archived"] is True and r.json()["archived_at"]
    assert client.post(f"/v1/jobs/{job}/archive", headers=alice).status_code == 200  # idempotent
    listed = [j["id"] for j in client.get("/v1/jobs", headers=alice).json()["items"]]
    assert listed == [other]
    only = client.get("/v1/jobs", params={"archived": "true"}, headers=alice).json()["items"]
    assert [j["id"] for j in only] == [job]
    r = client.post(f"/v1/jobs/{job}/unarchive", headers=alice)
    assert r.status_code == 200 and r.json()["archived"] is False
    assert {j["id"] for j in client.get("/v1/jobs", headers=alice).json()["items"]} == {job, other}
    actions = [e.action for e in _audit(factory.url) if e.target == f"job:{job}"]
    assert actions == ["job.archive", "job.unarchive"]  # the repeated archive changed nothing


# --- delete ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["queued", "starting", "running", "cancelling"])
def test_delete_refuses_a_job_that_has_not_ended(
    client: TestClient, alice: Headers, factory: Factory, state: str
) -> None:
    job = factory.job("alice", state)
    err = _error(client.delete(f"/v1/jobs/{job}", headers=alice), 409, "conflict")
    assert "cancel it first" in err["message"] and state in err["message"]
    assert client.get(f"/v1/jobs/{job}", headers=alice).json()["state"] == state
    assert _audit(factory.url, "job.delete") == []


def _full_job(client: TestClient, alice: Headers, factory: Factory, settings: Settings) -> str:
    """An ended job with a row in every table a job has, and files in storage."""
    r = client.post("/v1/jobs", json=SPEC, headers=alice | {"Idempotency-Key": "k1"})
    job = r.json()["id"]
    factory.set_state(job, "starting")
    factory.attempt(job, workers=2)
    factory.set_state(job, "running")
    client.patch(f"/v1/jobs/{job}", json={"tags": ["doomed"]}, headers=alice)
    folder = job_dir(settings.storage, job)
    (folder / "checkpoints").mkdir(parents=True)
    data = b"weights" * 100
    (folder / "checkpoints" / "step-00000004.pt").write_bytes(data)
    (folder / LOG_FILE).write_text("hello\n")
    (folder / "checkpoints" / ".tmp-half-written").write_bytes(b"x")  # a crash's leftover
    outside = settings.storage.parent / "not-the-jobs.txt"
    outside.write_text("stays")
    (folder / "link").symlink_to(outside)  # a trainer's link: removed, never followed
    with session_scope(factory.url) as s:
        ingest_metrics(s, job, [{"name": "train/loss", "step": k, "epoch": 1, "value": 1.0 / (k + 1), "time": 0.0} for k in range(100)])  # fmt: skip
        record_checkpoint(s, job, attempt=1, step=4, epoch=1.0, path="checkpoints/step-00000004.pt", bytes=len(data), sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
        owner = user_named(s, "alice")
        assert owner is not None
        sweep = Sweep(owner_id=owner.id, name="sw", spec=SPEC, space={}, metric="val/loss",
                      mode="min", max_trials=1, parallel=1, sampler="random", pruner="none",
                      seed=0, state="succeeded")  # fmt: skip
        s.add(sweep)
        s.flush()
        s.add(SweepTrial(sweep_id=sweep.id, number=0, job_id=job, params={"lr": 0.1}, outcome="complete", value=0.5))  # fmt: skip
    factory.set_state(job, "succeeded")
    return job


CHILDREN = (JobTag, JobEvent, Assignment, Attempt, Checkpoint, IdempotencyKey, Metric, MetricBlock)


def _rows_of(url: str, job_id: str) -> dict[str, int]:
    with session_scope(url) as s:
        counts = {m.__tablename__: s.scalar(select(func.count()).where(m.job_id == job_id)) or 0 for m in CHILDREN}  # fmt: skip
        counts["jobs"] = s.scalar(select(func.count()).where(Job.id == job_id)) or 0
        return counts


def test_delete_removes_every_row_and_file_and_keeps_the_audit(
    client: TestClient, alice: Headers, factory: Factory, settings: Settings
) -> None:
    job = _full_job(client, alice, factory, settings)
    keep = factory.job("alice", "succeeded")  # another job's files and rows are not touched
    (job_dir(settings.storage, keep) / LOG_FILE).parent.mkdir(parents=True)
    (job_dir(settings.storage, keep) / LOG_FILE).write_text("mine\n")
    assert all(_rows_of(factory.url, job).values())  # every table had rows of the job
    name = client.get(f"/v1/jobs/{job}", headers=alice).json()["name"]
    r = client.delete(f"/v1/jobs/{job}", headers=alice)
    assert r.status_code == 204 and r.content == b""
    assert set(_rows_of(factory.url, job).values()) == {0}
    assert not job_dir(settings.storage, job).exists()
    assert (settings.storage.parent / "not-the-jobs.txt").read_text() == "stays"
    assert (job_dir(settings.storage, keep) / LOG_FILE).read_text() == "mine\n"
    assert _rows_of(factory.url, keep)["jobs"] == 1
    _error(client.get(f"/v1/jobs/{job}", headers=alice), 404)
    _error(client.delete(f"/v1/jobs/{job}", headers=alice), 404)
    with session_scope(factory.url) as s:  # the trial keeps its values, without the job
        trial = s.scalar(select(SweepTrial))
        assert trial is not None and trial.job_id is None
        assert (trial.params, trial.outcome, trial.value) == ({"lr": 0.1}, "complete", 0.5)
    [entry] = _audit(factory.url, "job.delete")
    assert entry.target == f"job:{job}" and entry.user_name == "alice"
    assert entry.details == {"name": name, "state": "succeeded", "owner": "alice"}
    assert entry.project_id is not None
    assert [e.action for e in _audit(factory.url) if e.target == f"job:{job}"][-1] == "job.delete"
    # The idempotency key went with the job: the same key stores a new one.
    again = client.post("/v1/jobs", json=SPEC, headers=alice | {"Idempotency-Key": "k1"})
    assert again.status_code == 201 and again.json()["id"] != job


def test_delete_waits_for_the_sweep_to_record_a_trials_end(
    client: TestClient, alice: Headers, factory: Factory
) -> None:
    job = factory.job("alice", "succeeded")
    with session_scope(factory.url) as s:
        owner = user_named(s, "alice")
        assert owner is not None
        sweep = Sweep(owner_id=owner.id, name="sw", spec=SPEC, space={}, metric="val/loss",
                      mode="min", max_trials=1, parallel=1, sampler="random", pruner="none",
                      seed=0)  # fmt: skip
        s.add(sweep)
        s.flush()
        s.add(SweepTrial(sweep_id=sweep.id, number=0, job_id=job, params={}))
    err = _error(client.delete(f"/v1/jobs/{job}", headers=alice), 409, "conflict")
    assert "sweep" in err["message"]
    assert client.get(f"/v1/jobs/{job}", headers=alice).status_code == 200


def test_delete_files_goes_through_the_seam_and_is_idempotent(tmp_path: Path) -> None:
    store = MemoryStorage(tmp_path)
    mine, other = "a" * 32, "b" * 32
    for key in (f"jobs/{mine}/output.log", f"jobs/{mine}/checkpoints/step-1.pt", f"jobs/{other}/output.log", f"jobs/{mine}x/f"):  # fmt: skip
        store.write_bytes(key, b"x")
    assert delete_files(store, mine) == 2
    assert [o.key for o in store.list("")] == [f"jobs/{mine}x/f", f"jobs/{other}/output.log"]
    assert delete_files(store, mine) == 0  # again: nothing left, no error
    with pytest.raises(ValueError):
        delete_files(store, "../" + mine)  # never a path from outside


# --- who may ---------------------------------------------------------------------------------------


@pytest.fixture
def team(factory: Factory) -> dict[str, Any]:
    """Project `vision`: alice owns it, bob is a member, carol a viewer; dave is not in it.
    Jobs (ended): one alice submitted, two bob did."""
    for name in ("alice", "bob", "carol", "dave"):
        factory.user_id(name)
    with session_scope(factory.url) as s:
        users = {n: user_named(s, n) for n in ("alice", "bob", "carol")}
        project = create_project(s, "vision", users["alice"].id)  # type: ignore[union-attr]
        set_member(s, project, users["bob"], "member")  # type: ignore[arg-type]
        set_member(s, project, users["carol"], "viewer")  # type: ignore[arg-type]
        pid = project.id
    jobs = {
        "alices": factory.job("alice", "succeeded", project_id=pid),
        "bobs": factory.job("bob", "failed", project_id=pid),
        "bobs2": factory.job("bob", "cancelled", project_id=pid),
    }
    tokens = {n: {"Authorization": f"Bearer {factory.token(n)}"} for n in ("bob", "carol", "dave")}
    return {"jobs": jobs, **tokens}


def test_viewers_get_403_and_outsiders_404(client: TestClient, team: dict[str, Any]) -> None:
    job = team["jobs"]["alices"]
    for who, status in (("carol", 403), ("dave", 404)):
        h = team[who]
        _error(client.patch(f"/v1/jobs/{job}", json={"tags": ["x"]}, headers=h), status)
        _error(client.post(f"/v1/jobs/{job}/archive", headers=h), status)
        _error(client.post(f"/v1/jobs/{job}/unarchive", headers=h), status)
        _error(client.delete(f"/v1/jobs/{job}", headers=h), status)
    # A job that does not exist answers as one the caller may not see.
    _error(client.patch(f"/v1/jobs/{'0' * 32}", json={"tags": ["x"]}, headers=team["carol"]), 404)
    assert client.get(f"/v1/jobs/{job}", headers=team["carol"]).json()["tags"] == []


def test_members_edit_and_delete_their_own_owners_delete_any(
    client: TestClient, alice: Headers, admin: Headers, team: dict[str, Any], factory: Factory
) -> None:
    jobs, bob = team["jobs"], team["bob"]
    r = client.patch(f"/v1/jobs/{jobs['alices']}", json={"tags": ["by-bob"]}, headers=bob)
    assert r.status_code == 200 and r.json()["tags"] == ["by-bob"]
    assert client.post(f"/v1/jobs/{jobs['alices']}/archive", headers=bob).status_code == 200
    err = _error(client.delete(f"/v1/jobs/{jobs['alices']}", headers=bob), 403, "forbidden")
    assert "owners" in err["message"]
    assert client.delete(f"/v1/jobs/{jobs['bobs']}", headers=bob).status_code == 204
    assert client.delete(f"/v1/jobs/{jobs['bobs2']}", headers=alice).status_code == 204
    assert client.delete(f"/v1/jobs/{jobs['alices']}", headers=admin).status_code == 204
    deleted_by = {e.details["name"]: e.user_name for e in _audit(factory.url, "job.delete")}
    assert sorted(deleted_by.values()) == ["alice", "bob", "root"]
    assert all(e.project_id is not None for e in _audit(factory.url, "job.delete"))
