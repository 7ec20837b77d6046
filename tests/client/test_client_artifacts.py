"""`torchyard artifacts JOB [--download NAME] [-o PATH]` and the SDK's `artifacts` and
`download_artifact` against the real API: the list, a download verified by its sha256 (a
file whose bytes are not the recorded ones is never kept), a name the job has not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from client_server import Run, Store

from torchyard.client import errors
from torchyard.client.sdk import Client
from torchyard.store.artifacts import record_artifact
from torchyard.store.db import session_scope
from torchyard.store.paths import job_dir

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


def _artifact(
    store: Store, job: str, name: str, data: bytes, recorded: bytes | None = None
) -> None:
    target = job_dir(store.settings.storage, job) / "artifacts" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    rec = data if recorded is None else recorded
    with session_scope(store.url) as s:
        record_artifact(s, job, name=name, bytes=len(rec), sha256=hashlib.sha256(rec).hexdigest())


def test_list_and_download_through_the_cli(
    run: Run, store: Store, root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = store.job("root", state="succeeded")
    rc, out, err = run("artifacts", job)
    assert rc == 0 and "no artifacts" in err
    _artifact(store, job, "cm.png", PNG)
    _artifact(store, job, "cfg.yaml", b"lr: 0.1\n")
    rc, out, _ = run("artifacts", job[:8])
    assert rc == 0 and "cm.png" in out and "cfg.yaml" in out and "2.0 KiB" in out
    rc, out, _ = run("artifacts", job, "--json")
    assert [a["name"] for a in json.loads(out)] == ["cfg.yaml", "cm.png"]
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run("artifacts", job, "--download", "cm.png")
    assert rc == 0 and (tmp_path / "cm.png").read_bytes() == PNG
    assert f"sha256 {hashlib.sha256(PNG).hexdigest()} verified" in out
    rc, out, _ = run("artifacts", job, "-d", "cfg.yaml", "-o", str(tmp_path / "out") + "/")
    assert rc == 0 and (tmp_path / "out" / "cfg.yaml").read_bytes() == b"lr: 0.1\n"
    rc, _, err = run("artifacts", job, "-d", "nope.txt")
    assert rc == 1 and "no artifact 'nope.txt'" in err and "cfg.yaml, cm.png" in err


def test_a_download_that_does_not_hash_to_the_record_is_not_kept(
    ty: Client, store: Store, tmp_path: Path
) -> None:
    job = store.job("alice", state="succeeded")
    _artifact(store, job, "w.bin", b"what the disk holds", recorded=b"what was measured")
    with pytest.raises(errors.ChecksumError):
        ty.download_artifact(job, "w.bin", tmp_path)
    assert not (tmp_path / "w.bin").exists()
    (a,) = ty.artifacts(job)
    assert a["name"] == "w.bin" and a["available"] is True
