"""The SDK against an in-memory API (httpx.MockTransport): errors, config, downloads."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import httpx
import pytest
from client_fake_api import FakeAPI

from torchyard import client
from torchyard.client import errors
from torchyard.client.sdk import Client, default_filename, load_spec, resolve_config


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


@pytest.fixture
def ty(api: FakeAPI) -> Client:
    return Client("http://ty.test", api.token, transport=api.transport())


def test_public_exports_are_the_documented_tree() -> None:
    # Every name in client.errors.__all__ is re-exported and is a TorchyardError (bar helpers).
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert issubclass(obj, errors.TorchyardError)
            assert name in errors.__doc__, f"{name} missing from the tree in the docstring"
    for name in client.__all__:
        assert hasattr(client, name)


def test_422_becomes_invalid_spec_with_one_line_naming_each_field(ty: Client) -> None:
    with pytest.raises(errors.InvalidSpec) as e:
        ty.submit({"model": {"name": "mlp"}, "optimizer": {"lr": -1}, "batch_size": "x"})
    assert e.value.status == 422
    assert e.value.problems == [
        ("optimizer.lr", "must be > 0"),
        ("batch_size", "must be an integer"),
    ]
    assert (
        e.value.one_line()
        == "422 invalid spec: optimizer.lr: must be > 0; batch_size: must be an integer"
    )
    assert e.value.is_user_error


def test_wrong_token_is_unauthorized_and_missing_job_not_found(api: FakeAPI) -> None:
    bad = Client("http://ty.test", "ty_wrong", transport=api.transport())
    with pytest.raises(errors.Unauthorized):
        bad.jobs()
    ok = Client("http://ty.test", api.token, transport=api.transport())
    with pytest.raises(errors.NotFound):
        ok.job("0" * 32)


def test_error_for_reads_fastapi_detail_and_unknown_statuses() -> None:
    e = errors.error_for(400, {"detail": "bad cursor"})
    assert isinstance(e, errors.BadRequest) and e.message == "bad cursor"
    e = errors.error_for(500, None)
    assert type(e) is errors.APIError and e.one_line() == "500 error"


def test_unreachable_server_is_connect_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", "t") as ty, pytest.raises(errors.ConnectError) as e:
        ty.jobs()
    assert "connection refused" in str(e.value)


def test_submit_sends_bearer_token_and_idempotency_key(api: FakeAPI, ty: Client) -> None:
    job = ty.submit({"name": "a", "optimizer": {"lr": 0.1}}, idempotency_key="k-1")
    req = api.requests[-1]
    assert req.headers["Authorization"] == f"Bearer {api.token}"
    assert req.headers["Idempotency-Key"] == "k-1"
    assert job["state"] == "queued" and len(job["id"]) == 32


def test_resolve_config_order(tmp_path: Path) -> None:
    env = {"TORCHYARD_HOME": str(tmp_path)}
    assert resolve_config(env=env) == ("http://127.0.0.1:8000", None)
    (tmp_path / "admin-token").write_text("ty_file\n")
    (tmp_path / "url").write_text("http://up.local:9000\n")
    assert resolve_config(env=env) == ("http://up.local:9000", "ty_file")
    env |= {"TORCHYARD_URL": "http://env:1/", "TORCHYARD_TOKEN": "ty_env"}
    assert resolve_config(env=env) == ("http://env:1", "ty_env")
    assert resolve_config("http://flag:2", "ty_flag", env=env) == ("http://flag:2", "ty_flag")


def test_load_spec_reads_json_and_yaml_and_refuses_garbage(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("model:\n  name: mlp\nbatch_size: 32\n")
    assert load_spec(tmp_path / "a.yaml") == {"model": {"name": "mlp"}, "batch_size": 32}
    (tmp_path / "b.json").write_text('{"epochs": 1}')
    assert load_spec(tmp_path / "b.json") == {"epochs": 1}
    (tmp_path / "c.json").write_text("{nope")
    with pytest.raises(errors.SpecFileError, match="not valid JSON"):
        load_spec(tmp_path / "c.json")
    (tmp_path / "d.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(errors.SpecFileError, match="one object"):
        load_spec(tmp_path / "d.yaml")
    with pytest.raises(errors.SpecFileError, match="cannot read"):
        load_spec(tmp_path / "missing.json")


def _job(ty: Client) -> str:
    return ty.submit({"name": "dl"})["id"]


def test_download_verifies_and_names_the_file(api: FakeAPI, ty: Client, tmp_path: Path) -> None:
    jid = _job(ty)
    dl = ty.download(jid, path=tmp_path)
    assert dl.path == tmp_path / default_filename(jid, {"step": 0, "kind": "resume"})
    assert dl.path.read_bytes() == api.blob
    assert dl.sha256 == api.sha and dl.resumed_from == 0 and dl.format == "torch"
    assert not list(tmp_path.glob("*.part"))
    again = ty.download(jid, path=f"{tmp_path}/new/")  # a trailing slash names a directory
    assert again.path == tmp_path / "new" / dl.path.name


def test_download_resumes_a_part_file_with_range(api: FakeAPI, ty: Client, tmp_path: Path) -> None:
    jid, out = _job(ty), tmp_path / "m.pt"
    (tmp_path / "m.pt.part").write_bytes(api.blob[:1000])
    seen: list[tuple[int, int | None]] = []
    dl = ty.download(jid, "7", out, on_progress=lambda d, t: seen.append((d, t)))
    req = api.requests[-1]
    assert req.headers["Range"] == "bytes=1000-"
    assert req.headers["If-Range"] == f'"{api.sha}"'
    assert dl.resumed_from == 1000 and out.read_bytes() == api.blob
    assert seen[0] == (1000, len(api.blob)) and seen[-1] == (len(api.blob), len(api.blob))


def test_broken_download_leaves_a_part_that_the_next_call_resumes(
    api: FakeAPI, ty: Client, tmp_path: Path
) -> None:
    jid, out = _job(ty), tmp_path / "m.pt"
    api.cut_after = 5000
    with pytest.raises(errors.ConnectError, match="run the same command again"):
        ty.download(jid, path=out)
    assert (tmp_path / "m.pt.part").stat().st_size == 5000 and not out.exists()
    dl = ty.download(jid, path=out)
    assert dl.resumed_from == 5000 and hashlib.sha256(out.read_bytes()).hexdigest() == api.sha


def test_part_of_another_file_is_discarded_and_fetched_again(
    api: FakeAPI, ty: Client, tmp_path: Path
) -> None:
    jid, out = _job(ty), tmp_path / "m.pt"
    (tmp_path / "m.pt.part").write_bytes(b"x" * 1000)  # same length prefix, wrong bytes
    dl = ty.download(jid, path=out)
    assert out.read_bytes() == api.blob and dl.resumed_from == 0


def test_checksum_mismatch_raises_and_keeps_no_file(
    api: FakeAPI, ty: Client, tmp_path: Path
) -> None:
    jid, out = _job(ty), tmp_path / "m.pt"
    real_handle = api.handle

    def corrupt(req: httpx.Request) -> httpx.Response:
        resp = real_handle(req)
        if req.url.path.endswith("/download"):
            return httpx.Response(200, headers={"ETag": resp.headers["ETag"]}, content=b"evil")
        return resp

    with (
        Client("http://ty.test", api.token, transport=httpx.MockTransport(corrupt)) as ty2,
        pytest.raises(errors.ChecksumError),
    ):
        ty2.download(jid, path=out)
    assert not out.exists() and not (tmp_path / "m.pt.part").exists()


def test_wait_and_iter_jobs(api: FakeAPI, ty: Client) -> None:
    ids = {_job(ty), ty.submit({"name": "other"})["id"]}
    assert {j["id"] for j in ty.iter_jobs()} == ids
    updates: list[str] = []
    final = ty.wait(sorted(ids)[0], poll_s=0, on_update=lambda j: updates.append(j["state"]))
    assert final["state"] == "succeeded" and updates[0] == "running"


def test_sse_parser_decodes_json_and_keeps_event_names() -> None:
    from torchyard.client.sdk import _parse_sse

    lines = [": keep-alive", "event: state", 'data: {"state": "running"}', "", "data: plain", ""]
    assert list(_parse_sse(iter(lines))) == [("state", {"state": "running"}), ("message", "plain")]


def test_one_line_names_problems_the_message_leaves_out() -> None:
    details = [{"field": "a", "message": "bad"}, {"field": "b", "message": "worse"}]
    e = errors.error_for(
        422, {"error": {"code": "x", "message": "invalid spec", "details": details}}
    )
    assert e.one_line() == "422 invalid spec: a: bad; b: worse"
    e = errors.error_for(
        422, {"error": {"code": "x", "message": "invalid spec: a: bad", "details": details}}
    )
    assert e.one_line() == "422 invalid spec: a: bad; b: worse"
