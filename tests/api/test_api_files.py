"""Checkpoint listing and download (ETag, Range, 416, 304, `latest`), path containment,
and the log with offsets."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.settings import Settings
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope
from torchyard.store.models import Checkpoint
from torchyard.store.paths import LOG_FILE, job_dir

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes


def _ckpt(
    settings: Settings,
    db_url: str,
    job_id: str,
    rel: str,
    data: bytes,
    step: int,
    kind: str = "resume",
) -> int:
    target = job_dir(settings.storage, job_id) / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    with session_scope(db_url) as s:
        row = record_checkpoint(
            s, job_id, attempt=1, step=step, epoch=step / 10, path=rel, bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(), kind=kind,
        )  # fmt: skip
        return row.id


def _raw_row(db_url: str, job_id: str, path: str, step: int = 1) -> int:
    """A row written behind record_checkpoint's back, as a corrupted store might hold."""
    with session_scope(db_url) as s:
        row = Checkpoint(job_id=job_id, attempt=1, step=step, path=path, bytes=1, sha256="0" * 64)
        s.add(row)
        s.flush()
        return row.id


@pytest.fixture
def job(factory: Factory) -> str:
    return factory.job("alice", state="running")


def _url(job_id: str, ckpt: Any) -> str:
    return f"/v1/jobs/{job_id}/checkpoints/{ckpt}/download"


def test_list_and_full_download(
    client: TestClient, alice: dict[str, str], settings: Settings, db_url: str, job: str
) -> None:
    a = _ckpt(settings, db_url, job, "checkpoints/step-00000010.pt", PAYLOAD, 10)
    b = _ckpt(settings, db_url, job, "checkpoints/step-00000020.pt", PAYLOAD[:100], 20)
    os.remove(job_dir(settings.storage, job) / "checkpoints/step-00000010.pt")  # keep_last
    items = client.get(f"/v1/jobs/{job}/checkpoints", headers=alice).json()
    assert items["next_cursor"] is None
    assert [(c["id"], c["step"], c["available"]) for c in items["items"]] == [
        (a, 10, False),
        (b, 20, True),
    ]
    c = items["items"][1]
    assert c["bytes"] == 100 and c["sha256"] == hashlib.sha256(PAYLOAD[:100]).hexdigest()
    assert c["kind"] == "resume" and c["epoch"] == 2.0 and c["created_at"]
    r = client.get(_url(job, b), headers=alice)
    assert r.status_code == 200 and r.content == PAYLOAD[:100]
    assert r.headers["content-length"] == "100" and r.headers["accept-ranges"] == "bytes"
    assert r.headers["etag"] == f'"{c["sha256"]}"'
    gone = client.get(_url(job, a), headers=alice)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_gone"


def test_latest_alias(
    client: TestClient, alice: dict[str, str], settings: Settings, db_url: str, job: str
) -> None:
    assert client.get(_url(job, "latest"), headers=alice).status_code == 404
    _ckpt(settings, db_url, job, "checkpoints/step-00000010.pt", b"ten", 10)
    _ckpt(settings, db_url, job, "checkpoints/step-00000030.pt", b"thirty", 30)
    _ckpt(settings, db_url, job, "checkpoints/step-00000020.pt", b"twenty", 20)
    _ckpt(settings, db_url, job, "model.safetensors", b"weights", 30, kind="weights")
    assert client.get(_url(job, "latest"), headers=alice).content == b"thirty"
    r = client.get(_url(job, "latest"), params={"kind": "weights"}, headers=alice)
    assert r.content == b"weights"
    assert client.get(_url(job, "latest"), params={"kind": "x"}, headers=alice).status_code == 422


@pytest.mark.parametrize(
    ("range_", "status", "body", "content_range"),
    [
        ("bytes=0-0", 206, PAYLOAD[:1], "bytes 0-0/10240"),
        ("bytes=-10", 206, PAYLOAD[-10:], "bytes 10230-10239/10240"),
        ("bytes=10000-", 206, PAYLOAD[10000:], "bytes 10000-10239/10240"),
        ("bytes=100-199", 206, PAYLOAD[100:200], "bytes 100-199/10240"),
        ("bytes=10200-99999", 206, PAYLOAD[10200:], "bytes 10200-10239/10240"),
        ("bytes=-99999", 206, PAYLOAD, "bytes 0-10239/10240"),
        ("bytes=10240-", 416, None, "bytes */10240"),
        ("bytes=20000-20010", 416, None, "bytes */10240"),
        ("bytes=-0", 416, None, "bytes */10240"),
        ("bytes=0-1,5-6", 200, PAYLOAD, None),  # several ranges: whole file (documented)
        ("bytes=9-3", 200, PAYLOAD, None),  # invalid: ignored
        ("items=0-1", 200, PAYLOAD, None),  # unknown unit: ignored
        ("bytes=abc", 200, PAYLOAD, None),
    ],
)
def test_range_requests(
    client: TestClient,
    alice: dict[str, str],
    settings: Settings,
    db_url: str,
    job: str,
    range_: str,
    status: int,
    body: bytes | None,
    content_range: str | None,
) -> None:
    cid = _ckpt(settings, db_url, job, "checkpoints/step-00000001.pt", PAYLOAD, 1)
    r = client.get(_url(job, cid), headers=alice | {"Range": range_})
    assert r.status_code == status, r.text
    assert r.headers.get("content-range") == content_range
    if body is not None:
        assert r.content == body and r.headers["content-length"] == str(len(body))
    else:
        assert r.json()["error"]["code"] == "range_not_satisfiable"


def test_conditional_requests(
    client: TestClient, alice: dict[str, str], settings: Settings, db_url: str, job: str
) -> None:
    cid = _ckpt(settings, db_url, job, "checkpoints/step-00000001.pt", PAYLOAD, 1)
    etag = client.get(_url(job, cid), headers=alice).headers["etag"]
    r = client.get(_url(job, cid), headers=alice | {"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b""
    r = client.get(_url(job, cid), headers=alice | {"If-None-Match": '"other"'})
    assert r.status_code == 200
    resume = {"Range": "bytes=5000-", "If-Range": etag}
    assert client.get(_url(job, cid), headers=alice | resume).status_code == 206
    changed = {"Range": "bytes=5000-", "If-Range": '"stale"'}
    r = client.get(_url(job, cid), headers=alice | changed)
    assert r.status_code == 200 and r.content == PAYLOAD


def test_paths_leaving_the_job_directory_are_refused(
    client: TestClient,
    alice: dict[str, str],
    settings: Settings,
    db_url: str,
    job: str,
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"top secret")
    other = job_dir(settings.storage, "f" * 32)
    other.mkdir(parents=True)
    (other / "x.pt").write_bytes(b"another job's file")
    jd = job_dir(settings.storage, job)
    (jd / "checkpoints").mkdir(parents=True)
    (jd / "checkpoints/link.pt").symlink_to(secret)
    (jd / "checkpoints/dirlink").symlink_to(tmp_path)
    stored = [
        "../../../secret.txt",
        f"../{'f' * 32}/x.pt",
        "checkpoints/../../" + "f" * 32 + "/x.pt",
        str(secret),  # absolute
        "checkpoints/link.pt",  # symlink to a file outside
        "checkpoints/dirlink/secret.txt",  # through a symlinked directory
    ]
    for i, path in enumerate(stored):
        cid = _raw_row(db_url, job, path, step=i)
        r = client.get(_url(job, cid), headers=alice)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "file_refused"
        assert b"secret" not in r.content and b"another job" not in r.content
    listed = client.get(f"/v1/jobs/{job}/checkpoints", headers=alice).json()["items"]
    assert len(listed) == len(stored) and not any(c["available"] for c in listed)
    # hostile checkpoint ids in the URL never reach the filesystem
    for ckpt in ("..%2f..%2fsecret.txt", "%2e%2e", "..", "-1", "1.0", "latest%00", "99999999999"):
        r = client.get(f"/v1/jobs/{job}/checkpoints/{ckpt}/download", headers=alice)
        assert r.status_code == 404, ckpt
        assert b"secret" not in r.content


def test_logs_with_offsets(
    client: TestClient, alice: dict[str, str], settings: Settings, factory: Factory
) -> None:
    job = factory.job("alice", state="running")
    url = f"/v1/jobs/{job}/logs"
    empty = client.get(url, headers=alice).json()
    assert empty == {"data": "", "offset": 0, "next_offset": 0, "size": 0, "complete": False}
    log = job_dir(settings.storage, job) / LOG_FILE
    log.parent.mkdir(parents=True)
    text = "== attempt 1 ==\nepoch 1 loss 0.5 ✓\n"
    log.write_text(text, encoding="utf-8")
    size = len(text.encode())
    whole = client.get(url, headers=alice).json()
    assert whole == {
        "data": text,
        "offset": 0,
        "next_offset": size,
        "size": size,
        "complete": False,
    }
    # a limit that would cut the 3-byte ✓ stops before it
    cut = size - 3
    part = client.get(url, params={"offset": 0, "limit": cut}, headers=alice).json()
    assert part["data"] == text[: text.index("✓")] and part["next_offset"] == size - 4
    rest = client.get(url, params={"offset": part["next_offset"]}, headers=alice).json()
    assert part["data"] + rest["data"] == text
    past = client.get(url, params={"offset": size + 100}, headers=alice).json()
    assert past["data"] == "" and past["next_offset"] == size
    assert client.get(url, params={"offset": -1}, headers=alice).status_code == 422
    factory.set_state(job, "succeeded")
    done = client.get(url, params={"offset": size}, headers=alice).json()
    assert done["complete"] is True
    assert client.get(url, params={"limit": 5}, headers=alice).json()["complete"] is False


def test_each_ranks_log_where_run_directories_are_not_shared(
    client: TestClient,
    alice: dict[str, str],
    settings: Settings,
    factory: Factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a shared file system every rank writes the one log (served for any rank); on an
    object store each rank's host ships its own, served by `rank`. A rank the job does not
    have is a 422 naming `rank`."""
    import torchyard.api.routers.job_data as route
    from torchyard.storage import job_key
    from torchyard.storage.memory import MemoryStorage

    job = factory.job("alice", state="running", world_size=2)
    url = f"/v1/jobs/{job}/logs"
    shared = job_dir(settings.storage, job) / LOG_FILE
    shared.parent.mkdir(parents=True)
    shared.write_text("rank 0 and rank 1 lines\n")
    for rank in (0, 1):
        r = client.get(url, params={"rank": rank}, headers=alice)
        assert r.json()["data"] == "rank 0 and rank 1 lines\n"
    bad = client.get(url, params={"rank": 2}, headers=alice)
    assert bad.status_code == 422 and bad.json()["error"]["details"][0]["field"] == "rank"

    store = MemoryStorage(tmp_path / "scratch")
    monkeypatch.setattr(route, "storage_for", lambda _settings: store)
    store.append(job_key(job, "output.log"), b"rank 0 here\n")
    store.append(job_key(job, "output.rank1.log"), b"rank 1 here\n")
    assert client.get(url, headers=alice).json()["data"] == "rank 0 here\n"
    one = client.get(url, params={"rank": 1}, headers=alice).json()
    assert one["data"] == "rank 1 here\n" and one["size"] == len("rank 1 here\n")
