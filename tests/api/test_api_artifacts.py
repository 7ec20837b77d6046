"""Artifact list and download: only the job's viewers, the sha256 as ETag, Range; an image
served as its type only when its bytes are one (never by its name), anything else as an
octet-stream attachment, always nosniff; a link or a name that is not one never served.
On the local storage and the in-memory one (no local files: streamed from the seam)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

import torchyard.api.routers.artifacts as route
from torchyard.settings import Settings
from torchyard.storage import Storage, storage_for
from torchyard.storage.memory import MemoryStorage
from torchyard.store.artifacts import record_artifact
from torchyard.store.db import session_scope

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"x" * 20
HTML = b"<html><script>alert(document.cookie)</script></html>"
SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["local", "memory"])
def storage(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Storage:  # fmt: skip
    if request.param == "local":
        return storage_for(settings)
    other = MemoryStorage(tmp_path / "scratch")
    monkeypatch.setattr(route, "storage_for", lambda _settings: other)
    return other


def _save(storage: Storage, db_url: str, job: str, name: str, data: bytes) -> None:
    storage.write_bytes(storage.checkpoint_key(job, f"artifacts/{name}", _sha(data)), data)
    with session_scope(db_url) as s:
        record_artifact(s, job, name=name, bytes=len(data), sha256=_sha(data))


def _url(job: str, name: str) -> str:
    return f"/v1/jobs/{job}/artifacts/{name}/download"


def test_list_and_download_with_the_sha256(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], factory: Factory,
    db_url: str, storage: Storage,
) -> None:  # fmt: skip
    job = factory.job("alice", state="succeeded")
    _save(storage, db_url, job, "cm.png", PNG)
    _save(storage, db_url, job, "cfg.yaml", b"lr: 0.1\n")
    r = client.get(f"/v1/jobs/{job}/artifacts", headers=alice)
    assert r.status_code == 200
    items = r.json()["items"]
    assert [(a["name"], a["bytes"], a["sha256"], a["available"]) for a in items] == [
        ("cfg.yaml", 8, _sha(b"lr: 0.1\n"), True),
        ("cm.png", len(PNG), _sha(PNG), True),
    ]
    assert items[1]["path"] == "artifacts/cm.png"
    r = client.get(_url(job, "cm.png"), headers=alice)
    assert r.status_code == 200 and r.content == PNG
    assert r.headers["etag"] == f'"{_sha(PNG)}"' and r.headers["content-type"] == "image/png"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-disposition"].startswith("inline")
    r = client.get(_url(job, "cfg.yaml"), headers={**alice, "Range": "bytes=4-"})
    assert r.status_code == 206 and r.content == b"0.1\n"
    r = client.get(_url(job, "cm.png"), headers={**alice, "If-None-Match": f'"{_sha(PNG)}"'})
    assert r.status_code == 304
    # another user's job is not there for bob; neither is a name that is not one
    assert client.get(f"/v1/jobs/{job}/artifacts", headers=bob).status_code == 404
    assert client.get(_url(job, "cm.png"), headers=bob).status_code == 404
    assert client.get(_url(job, "nope.png"), headers=alice).status_code == 404
    assert client.get(_url(job, ".cm.png"), headers=alice).status_code == 404
    assert client.get(_url(job, "..%2Fevents.jsonl"), headers=alice).status_code == 404
    assert client.get(f"/v1/jobs/{job}/artifacts").status_code == 401


@pytest.mark.parametrize(
    ("name", "data", "media"),
    [
        ("page.png", HTML, "application/octet-stream"),  # a name is not a type
        ("x.svg", SVG, "application/octet-stream"),  # SVG runs scripts: never an image
        ("page.html", HTML, "application/octet-stream"),
        ("photo.bin", b"\xff\xd8\xff\xe0" + b"j" * 10, "image/jpeg"),
        ("anim", b"GIF89a" + b"g" * 10, "image/gif"),
        ("w.webp", WEBP, "image/webp"),
    ],
)
def test_only_image_bytes_are_served_as_an_image(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str,
    storage: Storage, name: str, data: bytes, media: str,
) -> None:  # fmt: skip
    job = factory.job("alice", state="succeeded")
    _save(storage, db_url, job, name, data)
    r = client.get(_url(job, name), headers=alice)
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-type"] == media
    assert r.headers["x-content-type-options"] == "nosniff"
    shown = "inline" if media.startswith("image/") else "attachment"
    assert r.headers["content-disposition"].startswith(shown)


def test_a_link_planted_in_the_run_dir_is_never_served(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str,
    settings: Settings, tmp_path: Path,
) -> None:  # fmt: skip
    job = factory.job("alice", state="succeeded")
    storage = storage_for(settings)
    secret = tmp_path / "secret"
    secret.write_bytes(b"the server's own")
    folder = storage.run_dir(job) / "artifacts"
    folder.mkdir(parents=True)
    os.symlink(secret, folder / "leak.txt")
    with session_scope(db_url) as s:
        record_artifact(s, job, name="leak.txt", bytes=16, sha256=_sha(b"the server's own"))
    r = client.get(f"/v1/jobs/{job}/artifacts", headers=alice)
    assert r.json()["items"][0]["available"] is False
    r = client.get(_url(job, "leak.txt"), headers=alice)
    assert r.status_code == 404 and b"the server's own" not in r.content
