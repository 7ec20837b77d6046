"""Submitting with code, against the real app: `Client.submit(spec, code=DIR)` packs DIR,
uploads the bundle only when the server does not have it from this user, and names it as
the job's `code.bundle`; `torchyard submit SPEC --code DIR` does the same from the CLI, and
a directory that cannot be packed is a one-line usage error."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_server import SPEC, Recorder, Store
from fastapi.testclient import TestClient
from sqlalchemy import select

from torchyard.client import errors
from torchyard.client.bundle import bundle_id, pack, pack_summary
from torchyard.client.cli import main
from torchyard.client.sdk import Client
from torchyard.store.auth import create_token
from torchyard.store.db import session_scope
from torchyard.store.models import Job

SCRIPT_SPEC: dict[str, Any] = {"name": "mine", "entrypoint": {"script": "train.py"}}


@pytest.fixture
def coder(store: Store) -> str:
    """A token of a user allowed to run their own code."""
    with session_scope(store.url) as s:
        return create_token(s, "carol", can_run_code=True)


@pytest.fixture
def rec(http: TestClient, coder: str) -> Iterator[tuple[Client, Recorder]]:
    recorder = Recorder(http._transport)
    with httpx.Client(base_url="http://ty.test", transport=recorder) as h:
        yield Client(token=coder, http=h), recorder


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    d = tmp_path / "code"
    d.mkdir()
    (d / "train.py").write_text("print('hello from my script')\n")
    (d / "data.bin").write_bytes(b"\0" * 1000)
    (d / ".torchyardignore").write_text("data.bin\n")
    return d


def _calls(recorder: Recorder, method: str, prefix: str = "/v1/bundles") -> int:
    return sum(r.method == method and r.url.path.startswith(prefix) for r in recorder.requests)


def _stored_spec(store: Store, job_id: str) -> dict[str, Any]:
    with session_scope(store.url) as s:
        spec = s.scalar(select(Job.spec).where(Job.id == job_id))
    assert spec is not None
    return spec


def test_submit_with_code_uploads_the_bundle_once(
    rec: tuple[Client, Recorder], code_dir: Path, store: Store
) -> None:
    ty, recorder = rec
    spec = copy.deepcopy(SCRIPT_SPEC)
    bid = bundle_id(pack(code_dir))
    first = ty.submit(spec, code=code_dir)
    assert spec == SCRIPT_SPEC  # the caller's dict is left alone
    assert first["spec"]["code"] == {"bundle": bid}
    assert _stored_spec(store, first["id"])["code"] == {"bundle": bid}
    assert (_calls(recorder, "GET"), _calls(recorder, "POST")) == (1, 1)
    upload = next(r for r in recorder.requests if r.method == "POST")
    assert upload.headers["Content-Type"] == "application/gzip"
    # train.py and .torchyardignore: data.bin was left out, as the ignore file says.
    assert ty.bundle(bid)["files"] == 2

    second = ty.submit(spec, code=str(code_dir))  # the same tree: the same bundle
    assert second["id"] != first["id"] and second["spec"]["code"] == {"bundle": bid}
    assert _calls(recorder, "POST") == 1

    (code_dir / "train.py").write_text("print('changed')\n")
    third = ty.submit(spec, code=code_dir)
    assert third["spec"]["code"]["bundle"] != bid
    assert _calls(recorder, "POST") == 2


def test_upload_bundle_and_bundle(rec: tuple[Client, Recorder], code_dir: Path) -> None:
    ty, _ = rec
    data = pack(code_dir)
    with pytest.raises(errors.NotFound):
        ty.bundle(bundle_id(data))
    body = ty.upload_bundle(data)
    assert body == {"id": bundle_id(data), "bytes": len(data), "files": 2}
    assert ty.bundle(body["id"]) == body
    with pytest.raises(errors.InvalidSpec, match="gzip"):
        ty.upload_bundle(b"not a tarball")


# -- the CLI -----------------------------------------------------------------------------------


def _cli(http: TestClient, capsys: pytest.CaptureFixture[str], token: str, *argv: str) -> Any:
    rc = main([*argv, "--token", token], http=http)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text("name: mine\nentrypoint: {script: train.py, args: ['--lr', '0.1']}\n")
    return p


def test_cli_submit_with_code(
    http: TestClient, capsys: pytest.CaptureFixture[str], coder: str, spec_file: Path,
    code_dir: Path, store: Store,
) -> None:  # fmt: skip
    rc, out, err = _cli(http, capsys, coder, "submit", str(spec_file), "--code", str(code_dir))
    assert rc == 0, err
    (job_id,) = out.split()
    spec = _stored_spec(store, job_id)
    assert spec["code"] == {"bundle": bundle_id(pack(code_dir))}
    assert spec["entrypoint"] == {"script": "train.py", "args": ["--lr", "0.1"]}


def test_cli_submit_with_code_says_what_it_sent(
    http: TestClient, capsys: pytest.CaptureFixture[str], coder: str, spec_file: Path,
    code_dir: Path,
) -> None:  # fmt: skip
    (code_dir / ".git").mkdir()
    (code_dir / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (code_dir / "weights.bin").write_bytes(b"\0" * (11 << 20))  # 11 MiB, compresses to ~11 KB
    rc, _, err = _cli(http, capsys, coder, "submit", str(spec_file), "--code", str(code_dir))
    assert rc == 0, err
    packed = pack_summary(code_dir, pack(code_dir))
    lines = [line for line in err.splitlines() if line.startswith("code: ")]
    assert len(lines) == 2, err
    assert lines[0].startswith(f"code: {packed.files} files, 11.0 MiB")
    assert "uploaded" in lines[0] and "left out: .git" in lines[0]
    assert "weights.bin (11.0 MiB)" in lines[1] and ".torchyardignore" in lines[1]
    rc, _, err = _cli(http, capsys, coder, "submit", str(spec_file), "--code", str(code_dir))
    assert rc == 0 and "already on the server" in err


def test_cli_submit_code_errors_are_one_line(
    http: TestClient, capsys: pytest.CaptureFixture[str], coder: str, token: str,
    spec_file: Path, code_dir: Path, tmp_path: Path,
) -> None:  # fmt: skip
    (tmp_path / "empty").mkdir()
    for directory, why in ((tmp_path / "nowhere", "no such directory"),
                           (tmp_path / "empty", "no files to pack")):  # fmt: skip
        rc, out, err = _cli(http, capsys, coder, "submit", str(spec_file), "--code", str(directory))
        assert (rc, out) == (2, "")
        assert err.startswith("error: ") and why in err and len(err.splitlines()) == 1
    # A user without the permission: the server's 403, naming how to get it.
    rc, out, err = _cli(http, capsys, token, "submit", str(spec_file), "--code", str(code_dir))
    assert rc == 1 and out == ""
    assert "403" in err and "--can-run-code" in err and "Traceback" not in err
    # A script missing from the bundle: the server's 422 on entrypoint.script, exit 2.
    spec_file.write_text("entrypoint: {script: other.py}\n")
    rc, _, err = _cli(http, capsys, coder, "submit", str(spec_file), "--code", str(code_dir))
    assert rc == 2 and "entrypoint.script" in err and "'other.py'" in err


def test_submit_without_code_is_unchanged(ty: Client) -> None:
    job = ty.submit(SPEC)
    assert job["spec"].get("code") is None
