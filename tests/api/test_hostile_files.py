"""Hostile tenants, issue 25: a job plants links (or a FIFO) in its own run directory. The
log route, the event stream's `log_size` and checkpoint downloads never follow a link: a
clear 404 (`file_refused`), never a 500, never the target's bytes or size; a file swapped
for a link after the route checked it is still never what is sent."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.fanout import stored_log_size
from torchyard.api.routers import checkpoints as checkpoints_route
from torchyard.settings import Settings
from torchyard.storage import storage_for
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope
from torchyard.store.paths import LOG_FILE, job_dir

pytestmark = pytest.mark.hostile

SECRET = b"root:x:0:0:top secret of the host\n"


@pytest.fixture
def job(factory: Factory) -> str:
    return factory.job("alice", state="running")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "host-secret"
    path.write_bytes(SECRET)
    return path


def _neighbour_log(settings: Settings, factory: Factory) -> Path:
    """Another user's job with a log of its own."""
    other = job_dir(settings.storage, factory.job("bob", state="running"))
    other.mkdir(parents=True)
    (other / LOG_FILE).write_bytes(b"bob's private log line\n")
    return other / LOG_FILE


@pytest.mark.parametrize("target", ["host", "neighbour", "own"])
def test_a_symlinked_log_is_a_clear_404_and_never_its_target(
    client: TestClient,
    alice: dict[str, str],
    settings: Settings,
    factory: Factory,
    job: str,
    secret: Path,
    target: str,
) -> None:
    run = job_dir(settings.storage, job)
    run.mkdir(parents=True)
    (run / "events.jsonl").write_bytes(b'{"type": "started"}\n')
    pointed = {
        "host": secret,
        "neighbour": _neighbour_log(settings, factory),
        "own": run / "events.jsonl",  # inside the job's own folder: still a link
    }[target]
    (run / LOG_FILE).symlink_to(pointed)
    r = client.get(f"/v1/jobs/{job}/logs", headers=alice)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "file_refused"
    assert pointed.read_bytes().decode() not in r.text
    # The event stream's status line: the size of no link's target.
    assert stored_log_size(storage_for(settings), job) == 0


def test_a_log_under_a_symlinked_folder_is_refused(
    settings: Settings, factory: Factory, job: str
) -> None:
    """The run directory's parts are never followed either (jobs/<id> itself a link)."""
    neighbour = _neighbour_log(settings, factory)
    run = job_dir(settings.storage, job)
    run.parent.mkdir(parents=True, exist_ok=True)
    run.symlink_to(neighbour.parent)
    assert stored_log_size(storage_for(settings), job) == 0


def test_a_fifo_as_the_log_never_hangs_the_api(
    client: TestClient, alice: dict[str, str], settings: Settings, job: str
) -> None:
    run = job_dir(settings.storage, job)
    run.mkdir(parents=True)
    fifo = run / LOG_FILE
    os.mkfifo(fifo)
    got: list[Any] = []
    asker = threading.Thread(target=lambda: got.append(client.get(f"/v1/jobs/{job}/logs", headers=alice)))  # fmt: skip
    asker.start()
    asker.join(10)
    if asker.is_alive():  # the old code blocked in open() until a writer came: be one
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        asker.join(10)
        pytest.fail("the log route hung opening a FIFO")
    assert got[0].status_code == 200 and got[0].json()["size"] == 0
    assert stored_log_size(storage_for(settings), job) == 0


def _checkpoint(settings: Settings, db_url: str, job: str, data: bytes) -> int:
    target = job_dir(settings.storage, job) / "checkpoints" / "step-1.pt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    with session_scope(db_url) as s:
        row = record_checkpoint(
            s, job, attempt=1, step=1, epoch=0.0, path="checkpoints/step-1.pt",
            bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
        return row.id


def test_a_checkpoint_linked_inside_its_own_folder_is_refused(
    client: TestClient, alice: dict[str, str], settings: Settings, db_url: str, job: str
) -> None:
    cid = _checkpoint(settings, db_url, job, b"weights")
    run = job_dir(settings.storage, job)
    (run / "events.jsonl").write_bytes(b"private events")
    path = run / "checkpoints" / "step-1.pt"
    path.unlink()
    path.symlink_to(run / "events.jsonl")
    r = client.get(f"/v1/jobs/{job}/checkpoints/{cid}/download", headers=alice)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_refused"
    assert b"private events" not in r.content


def test_a_checkpoint_swapped_for_a_link_after_the_check_is_never_sent(
    client: TestClient,
    alice: dict[str, str],
    settings: Settings,
    db_url: str,
    job: str,
    secret: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = b"the real weights" * 100
    cid = _checkpoint(settings, db_url, job, data)
    path = job_dir(settings.storage, job) / "checkpoints" / "step-1.pt"
    real = checkpoints_route.file_response

    def swap_then_serve(first: Any, **kw: Any) -> Any:
        # the job wins the race: between the route's checks and the bytes going out
        path.unlink()
        path.symlink_to(secret)
        return real(first, **kw)

    monkeypatch.setattr(checkpoints_route, "file_response", swap_then_serve)
    r = client.get(f"/v1/jobs/{job}/checkpoints/{cid}/download", headers=alice)
    assert SECRET not in r.content
    assert r.status_code == 200 and r.content == data  # the file that was checked
