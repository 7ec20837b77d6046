"""The SDK against the real API (a TestClient of create_app on SQLite): errors, config,
downloads with resume, the event stream and its resumption."""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from client_server import BLOB, SPEC, STEPS, Recorder, Store
from fastapi.testclient import TestClient

from torchyard import client
from torchyard.client import errors
from torchyard.client.sdk import Client, default_filename, load_spec, resolve_config

SHA = hashlib.sha256(BLOB).hexdigest()


@pytest.fixture
def rec(http: TestClient, token: str) -> Iterator[tuple[Client, Recorder]]:
    """A Client whose requests go through a Recorder around the app."""
    recorder = Recorder(http._transport)
    with httpx.Client(base_url="http://ty.test", transport=recorder) as h:
        yield Client(token=token, http=h), recorder


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
        ty.submit({**SPEC, "optimizer": {"name": "sgd", "lr": -1}, "batch_size": "x"})
    assert e.value.status == 422 and e.value.is_user_error
    fields = [f for f, _ in e.value.problems]
    assert "optimizer.lr" in fields and "batch_size" in fields
    line = e.value.one_line()
    assert line.startswith("422 ") and "\n" not in line
    assert all(f"{f}: {m}" in line for f, m in e.value.problems)  # each problem, in its words


def test_wrong_token_is_unauthorized_and_missing_job_not_found(
    http: TestClient, ty: Client
) -> None:
    with pytest.raises(errors.NotFound):
        ty.job("0" * 32)
    with pytest.raises(errors.Unauthorized):
        Client(token="ty_wrong", http=http).jobs()


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
    with Client(f"http://127.0.0.1:{port}", "t") as ty, pytest.raises(errors.ConnectError):
        next(ty.stream_events("0" * 32))  # a stream that never opened is not retried


def test_submit_sends_bearer_token_and_idempotency_key(
    rec: tuple[Client, Recorder], token: str
) -> None:
    ty, recorder = rec
    job = ty.submit(SPEC, idempotency_key="k-1")
    req = recorder.requests[-1]
    assert req.headers["Authorization"] == f"Bearer {token}"
    assert req.headers["Idempotency-Key"] == "k-1"
    assert job["state"] == "queued" and len(job["id"]) == 32
    assert ty.submit(SPEC, idempotency_key="k-1")["id"] == job["id"]  # the server kept the key


def test_resolve_config_order(tmp_path: Path) -> None:
    env = {"TORCHYARD_HOME": str(tmp_path), "TORCHYARD_CONFIG": str(tmp_path / "none.json")}
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


def _job(ty: Client, store: Store) -> str:
    """A job with one checkpoint file (BLOB) on record."""
    jid = ty.submit(SPEC)["id"]
    store.checkpoint(jid)
    return jid


def test_download_verifies_and_names_the_file(ty: Client, store: Store, tmp_path: Path) -> None:
    jid = _job(ty, store)
    dl = ty.download(jid, path=tmp_path)
    assert dl.path == tmp_path / default_filename(jid, {"step": STEPS, "kind": "resume"})
    assert dl.path.read_bytes() == BLOB
    assert dl.sha256 == SHA and dl.resumed_from == 0 and dl.format == "torch"
    assert not list(tmp_path.glob("*.part"))
    again = ty.download(jid, path=f"{tmp_path}/new/")  # a trailing slash names a directory
    assert again.path == tmp_path / "new" / dl.path.name
    with pytest.raises(errors.NotFound, match="no checkpoint 999"):
        ty.download(jid, "999", tmp_path)


def test_a_checkpoint_is_named_by_step_or_id_and_a_clash_is_asked_about(
    ty: Client, store: Store
) -> None:
    jid = ty.submit(SPEC)["id"]
    ids = {step: store.checkpoint(jid, step=step) for step in (20, 40)}
    assert ty.checkpoint(jid, "40")["id"] == ids[40]  # as status and the dashboard show it
    assert ty.checkpoint(jid, "step:20")["id"] == ids[20]
    assert ty.checkpoint(jid, f"id:{ids[20]}")["step"] == 20
    with pytest.raises(errors.NotFound, match=r"no checkpoint 230 .*available: step 20 \(id"):
        ty.checkpoint(jid, 230)
    with pytest.raises(errors.NotFound, match="has no final weights yet"):
        ty.checkpoint(jid, "weights")
    with pytest.raises(errors.NotFound, match="not a checkpoint: 'step:x'"):
        ty.checkpoint(jid, "step:x")
    store.checkpoint(jid, step=ids[20])  # a step equal to another checkpoint's id
    with pytest.raises(errors.NotFound, match=f"say id:{ids[20]} or step:{ids[20]}"):
        ty.checkpoint(jid, ids[20])


def test_download_resumes_a_part_file_with_range(
    rec: tuple[Client, Recorder], store: Store, tmp_path: Path
) -> None:
    ty, recorder = rec
    jid, out = _job(ty, store), tmp_path / "m.pt"
    (tmp_path / "m.pt.part").write_bytes(BLOB[:1000])
    seen: list[tuple[int, int | None]] = []
    dl = ty.download(jid, "latest", out, on_progress=lambda d, t: seen.append((d, t)))
    req = recorder.requests[-1]
    assert req.headers["Range"] == "bytes=1000-"
    assert req.headers["If-Range"] == f'"{SHA}"'
    assert dl.resumed_from == 1000 and out.read_bytes() == BLOB
    assert seen[0] == (1000, len(BLOB)) and seen[-1] == (len(BLOB), len(BLOB))


def test_broken_download_leaves_a_part_that_the_next_call_resumes(
    rec: tuple[Client, Recorder], store: Store, tmp_path: Path
) -> None:
    ty, recorder = rec
    jid, out = _job(ty, store), tmp_path / "m.pt"
    recorder.cut_after = 5000
    with pytest.raises(errors.ConnectError, match="run the same command again"):
        ty.download(jid, path=out)
    assert (tmp_path / "m.pt.part").stat().st_size == 5000 and not out.exists()
    dl = ty.download(jid, path=out)
    assert dl.resumed_from == 5000 and hashlib.sha256(out.read_bytes()).hexdigest() == SHA


def test_part_of_another_file_is_discarded_and_fetched_again(
    ty: Client, store: Store, tmp_path: Path
) -> None:
    jid, out = _job(ty, store), tmp_path / "m.pt"
    (tmp_path / "m.pt.part").write_bytes(b"x" * 1000)  # same length prefix, wrong bytes
    dl = ty.download(jid, path=out)
    assert out.read_bytes() == BLOB and dl.resumed_from == 0


def test_checksum_mismatch_raises_and_keeps_no_file(
    rec: tuple[Client, Recorder], store: Store, tmp_path: Path
) -> None:
    ty, recorder = rec
    jid, out = _job(ty, store), tmp_path / "m.pt"
    recorder.corrupt = True
    with pytest.raises(errors.ChecksumError):
        ty.download(jid, path=out)
    assert not out.exists() and not (tmp_path / "m.pt.part").exists()


def test_wait_and_iter_jobs(ty: Client, store: Store) -> None:
    ids = [ty.submit(SPEC)["id"], ty.submit({**SPEC, "name": "other"})["id"]]
    assert {j["id"] for j in ty.iter_jobs(page_size=1)} == set(ids)  # two pages
    store.run(ids[0])
    updates: list[str] = []
    final = ty.wait(ids[0], poll_s=0, on_update=lambda j: updates.append(j["state"]))
    assert final["state"] == "succeeded" and updates == ["succeeded"]
    with pytest.raises(TimeoutError, match="still queued"):
        ty.wait(ids[1], poll_s=0.01, timeout_s=0.05)


def test_events_of_a_finished_job(ty: Client, store: Store) -> None:
    jid = ty.submit(SPEC)["id"]
    store.run(jid)
    events = list(ty.events(jid))
    states = [d["state"] for e, d in events if e == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    metrics = [(d["name"], d["step"]) for e, d in events if e == "metric"]
    assert ("train/loss", STEPS) in metrics and len(metrics) == STEPS + STEPS // 2
    ck = next(d for e, d in events if e == "checkpoint")
    assert ck["sha256"] == SHA and ck["step"] == STEPS
    assert events[-1] == ("end", {"state": "succeeded"})


def test_stream_events_follows_a_live_job_and_resumes_after_a_drop(
    rec: tuple[Client, Recorder], store: Store
) -> None:
    ty, recorder = rec
    ty.reconnect_delay_s = 0.01
    jid = ty.submit(SPEC)["id"]
    recorder.cut_events = 5  # a few events in, the connection breaks
    retries: list[errors.TorchyardError] = []
    seen = []
    for ev in ty.stream_events(jid, on_retry=retries.append):
        seen.append(ev)
        if len(seen) == 1:  # the stream is open: the job starts now
            threading.Thread(target=store.run, args=(jid,), daemon=True).start()
    assert len(retries) == 1 and isinstance(retries[0], errors.ConnectError)
    streams = [r for r in recorder.requests if r.url.path.endswith("/events")]
    assert len(streams) == 2 and "Last-Event-ID" not in streams[0].headers
    assert streams[1].headers["Last-Event-ID"] in [e.id for e in seen]
    # `end` repeats the last position; `status` events carry none
    ids = [e.id for e in seen if e.event not in ("end", "status")]
    assert len(ids) == len(set(ids))  # nothing seen twice
    states = [e.data["state"] for e in seen if e.event == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    loss = [e.data["step"] for e in seen if e.event == "metric" and e.data["name"] == "train/loss"]
    assert loss == list(range(1, STEPS + 1))  # nothing lost either
    assert seen[-1].event == "end" and seen[-1].data == {"state": "succeeded"}


def test_stream_events_gives_up_after_reconnect_for_s(rec: tuple[Client, Recorder]) -> None:
    ty, recorder = rec
    ty.reconnect_delay_s = 0.02
    jid = ty.submit(SPEC)["id"]
    recorder.cut_events = 2  # the status and `queued` events, then the server is gone
    retries: list[errors.TorchyardError] = []
    events = ty.stream_events(jid, reconnect_for_s=0.3, on_retry=retries.append)
    assert next(events).event == "status"
    assert next(events).data["state"] == "queued"
    recorder.down = True
    with pytest.raises(errors.ConnectError, match="connection refused"):
        next(events)  # the break, then refused reconnects for 0.3 s
    assert len(retries) >= 2


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


@pytest.mark.parametrize(
    ("spec", "says", "never"),
    [
        ({"model": {"name": "mlp"}, "data": {"name": "digits"}},
         ["torchyard.load_model(", "uint8 pixels 0..16", "[N, 1, 8, 8]"], ["code=DIR"]),
        ({"model": {"name": "lenet"}, "data": {"name": "cifar10"}},
         ["[N, 3, 32, 32]"], ["0..16", "code=DIR"]),
        ({"model": {"name": "mine:build"}, "data": {"name": "imagefolder/flowers",
                                                     "image_size": 96}, "code": {"bundle": "x"}},
         ["code=DIR)", "--code", "[N, 3, 96, 96]"], ["0..16"]),
        ({"entrypoint": {"script": "train.py"}, "code": {"bundle": "x"}},
         ["model.load_state_dict(load_file("], ["torchyard.load_model(", "0..16"]),
    ],
)  # fmt: skip
def test_the_download_hint_fits_the_job(
    spec: dict, says: list[str], never: list[str], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    from torchyard.client.cmd_results import describe_download
    from torchyard.client.sdk import Download

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(1)}, str(path))
    dl = Download(path=path, bytes=10, sha256="0" * 64, resumed_from=0,
                  checkpoint={"id": 3, "step": 9, "kind": "weights"})  # fmt: skip
    assert dl.format == "safetensors"
    text = describe_download(dl, spec)
    assert all(s in text for s in says), text
    assert not any(n in text for n in never), text
