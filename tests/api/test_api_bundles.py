"""Code bundles through the real app on both databases: POST /v1/bundles (201, then 200 for
the same bytes; 413, 415, 422 leaving nothing behind; nothing written outside
`<storage>/bundles`), GET /v1/bundles/{id} (owners and admins only), and what a submit that
runs code needs: the permission (403 `forbidden`), a bundle of one's own holding the
entrypoint script, and an `init.from_job` of one's own with the checkpoint asked for."""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from proclib import tar_gz
from support.db import SPEC, Factory

from torchyard.client.bundle import pack
from torchyard.settings import Settings
from torchyard.storage import storage_for
from torchyard.store import bundles as store_bundles
from torchyard.store.auth import create_token
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope

GZIP = {"Content-Type": "application/gzip"}
Headers = dict[str, str]


@pytest.fixture
def coder(db_url: str) -> Headers:
    """A user allowed to run their own code (`token create --can-run-code`)."""
    with session_scope(db_url) as s:
        return {"Authorization": f"Bearer {create_token(s, 'carol', can_run_code=True)}"}


@pytest.fixture
def alice(db_url: str) -> Headers:
    """Here alice and bob may run code: uploading a bundle needs it (test_hostile_bundles.py
    checks the 403 of a user who may not)."""
    with session_scope(db_url) as s:
        return {"Authorization": f"Bearer {create_token(s, 'alice', can_run_code=True)}"}


@pytest.fixture
def bob(db_url: str) -> Headers:
    with session_scope(db_url) as s:
        return {"Authorization": f"Bearer {create_token(s, 'bob', can_run_code=True)}"}


@pytest.fixture
def plain(db_url: str) -> Headers:
    """A user who may not run their own code."""
    with session_scope(db_url) as s:
        return {"Authorization": f"Bearer {create_token(s, 'dora')}"}


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    d = tmp_path / "code"
    (d / "pkg").mkdir(parents=True)
    (d / "train.py").write_text("import pkg.net\nprint('training')\n")
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "net.py").write_text("def build(**kw):\n    return None\n")
    return d


@pytest.fixture
def bundle(code_dir: Path) -> bytes:
    return pack(code_dir)


def _upload(client: TestClient, headers: Headers, data: Any, **extra: str) -> Any:
    return client.post("/v1/bundles", content=data, headers=headers | GZIP | extra)


def _error(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


def _tree(root: Path) -> set[str]:
    """Every path under root, the SQLite files (which every request may touch) left out."""
    return {
        str(p.relative_to(root)) for p in root.rglob("*") if not p.name.startswith("torchyard.db")
    }


def _bundle_dir(settings: Settings) -> Path:
    return settings.storage / "bundles"


def _script_spec(bundle_id: str, script: str = "train.py") -> dict[str, Any]:
    return {"code": {"bundle": bundle_id}, "entrypoint": {"script": script, "args": ["--x"]}}


def _count_jobs(client: TestClient, headers: Headers) -> int:
    return len(client.get("/v1/jobs", headers=headers).json()["items"])


# -- upload and look up -----------------------------------------------------------------------


def test_upload_is_201_then_200_with_the_same_id(
    client: TestClient, alice: Headers, bundle: bytes, settings: Settings
) -> None:
    first = _upload(client, alice, bundle)
    assert first.status_code == 201, first.text
    body = first.json()
    assert body == {"id": hashlib.sha256(bundle).hexdigest(), "bytes": len(bundle), "files": 3}
    again = _upload(client, alice, bundle)
    assert again.status_code == 200 and again.json() == body
    shown = client.get(f"/v1/bundles/{body['id']}", headers=alice)
    assert shown.status_code == 200 and shown.json() == body
    stored = _bundle_dir(settings)
    assert (stored / f"{body['id']}.tar.gz").read_bytes() == bundle
    names = store_bundles.bundle_names(storage_for(settings), body["id"])
    assert names == ["pkg/__init__.py", "pkg/net.py", "train.py"]
    assert list((stored / "tmp").iterdir()) == []


def test_only_the_owner_and_admins_see_a_bundle(
    client: TestClient, alice: Headers, bob: Headers, admin: Headers, bundle: bytes,
    settings: Settings,
) -> None:  # fmt: skip
    bid = _upload(client, alice, bundle).json()["id"]
    missing_job = _error(client.get(f"/v1/jobs/{'f' * 32}", headers=bob), 404, "not_found")
    for other in (bid, "0" * 64, "not-an-id", "A" * 64):
        err = _error(client.get(f"/v1/bundles/{other}", headers=bob), 404, "not_found")
        assert err.keys() == missing_job.keys()
    assert client.get(f"/v1/bundles/{bid}", headers=admin).status_code == 200
    assert client.get(f"/v1/bundles/{bid}").status_code == 401
    # The same bytes from bob: a row of his own (201), still one file on disk.
    assert _upload(client, bob, bundle).status_code == 201
    assert client.get(f"/v1/bundles/{bid}", headers=bob).status_code == 200
    assert sorted(p.name for p in _bundle_dir(settings).iterdir()) == [
        f"{bid}.files.json",
        f"{bid}.tar.gz",
        "tmp",
    ]


def test_a_body_that_is_not_gzip_is_422(
    client: TestClient, alice: Headers, settings: Settings
) -> None:
    for body in (b"print('hello')\n", b""):
        err = _error(_upload(client, alice, body), 422, "validation_error")
        assert [d["field"] for d in err["details"]] == ["body"]
        assert "gzip" in err["message"]
    assert list(_bundle_dir(settings).rglob("*.gz")) == []
    assert list((_bundle_dir(settings) / "tmp").iterdir()) == []


def test_another_content_type_is_415(client: TestClient, alice: Headers, bundle: bytes) -> None:
    for content_type in ("application/json", "application/octet-stream", "text/plain"):
        r = client.post(
            "/v1/bundles", content=bundle, headers=alice | {"Content-Type": content_type}
        )
        err = _error(r, 415, "unsupported_media_type")
        assert "application/gzip" in err["message"]
    assert _upload(client, alice, bundle, **{"Content-Type": "application/gzip; x=1"}).is_success


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(
    client: TestClient, alice: Headers, app: Any, settings: Settings
) -> None:
    app.state.settings = app.state.settings.model_copy(update={"max_bundle_bytes": 4096})
    data = os.urandom(10_000)
    err = _error(_upload(client, alice, data), 413, "payload_too_large")
    assert "TORCHYARD_MAX_BUNDLE_BYTES" in err["message"] and "4096" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives, refused once past the limit
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    err = _error(_upload(client, alice, chunks()), 413, "payload_too_large")
    assert "TORCHYARD_MAX_BUNDLE_BYTES" in err["message"]
    assert list((_bundle_dir(settings) / "tmp").iterdir()) == []
    assert list(_bundle_dir(settings).glob("*.gz")) == []


def test_a_bundle_over_the_json_body_limit_passes_the_middleware(
    client: TestClient, alice: Headers, app: Any, tmp_path: Path
) -> None:
    limit = app.state.settings.max_body_bytes
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(os.urandom(limit + 100_000))  # incompressible
    data = pack(big)
    assert len(data) > limit
    r = _upload(client, alice, data)
    assert r.status_code == 201, r.text
    assert r.json()["bytes"] == len(data)
    # The JSON routes keep their own limit.
    _error(
        client.post("/v1/jobs", content=b" " * (limit + 1), headers=alice), 413, "payload_too_large"
    )


def test_a_hostile_archive_is_422_naming_the_member_and_nothing_leaves_bundles(
    client: TestClient, alice: Headers, bundle: bytes, settings: Settings, tmp_path: Path
) -> None:
    before = _tree(tmp_path)
    err = _error(_upload(client, alice, tar_gz({"../x": b"owned"})), 422, "validation_error")
    assert [d["field"] for d in err["details"]] == ["body"]
    assert "'../x'" in err["message"]
    assert _upload(client, alice, bundle).status_code == 201
    new = _tree(tmp_path) - before
    assert new and all(p == "storage" or p.startswith("storage/bundles") for p in new), new
    assert not (tmp_path / "x").exists() and not (settings.storage / "x").exists()
    assert list((_bundle_dir(settings) / "tmp").iterdir()) == []


def test_the_openapi_schema_documents_the_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    upload = paths["/v1/bundles"]["post"]
    assert {"201", "200", "413", "415", "422"} <= set(upload["responses"])
    assert "application/gzip" in upload["description"]
    assert "404" in paths["/v1/bundles/{bundle_id}"]["get"]["responses"]
    assert "403" in paths["/v1/jobs"]["post"]["responses"]


# -- the store: one row per owner, even under a race --------------------------------------------


def test_record_bundle_is_idempotent_under_a_race(
    db_url: str, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid, bid = factory.user_id("alice"), "ab" * 32
    with session_scope(db_url) as s:
        assert store_bundles.record_bundle(s, uid, bid, 10, 1) is True
    # A racing upload that looked before the row was there: its insert hits the key.
    monkeypatch.setattr(store_bundles, "get_bundle", lambda *a: None)
    with session_scope(db_url) as s:
        assert store_bundles.record_bundle(s, uid, bid, 10, 1) is False
        monkeypatch.undo()
        row = store_bundles.get_bundle(s, uid, bid)  # the session is still usable
        assert row is not None and (row.bytes, row.files) == (10, 1)


# -- submitting code -------------------------------------------------------------------------


def test_submitting_code_needs_the_permission(
    client: TestClient, alice: Headers, plain: Headers, bundle: bytes
) -> None:
    err = _error(_upload(client, plain, bundle), 403, "forbidden")  # uploading needs it too
    assert "torchyard token create --user NAME --can-run-code" in err["message"]
    bid = _upload(client, alice, bundle).json()["id"]
    factory_model = copy.deepcopy(SPEC) | {"model": {"name": "mynets:small"}}
    for spec in (_script_spec(bid), factory_model, SPEC | {"code": {"bundle": bid}}):
        err = _error(client.post("/v1/jobs", json=spec, headers=plain), 403, "forbidden")
        assert "may not run their own code" in err["message"]
        assert "torchyard token create --user NAME --can-run-code" in err["message"]
    assert _count_jobs(client, plain) == 0
    assert client.post("/v1/jobs", json=SPEC, headers=plain).status_code == 201


def test_a_user_allowed_to_run_code_and_an_admin_may(
    client: TestClient, coder: Headers, admin: Headers, bundle: bytes
) -> None:
    bid = _upload(client, coder, bundle).json()["id"]
    r = client.post("/v1/jobs", json=_script_spec(bid), headers=coder)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["spec"]["code"] == {"bundle": bid}
    assert job["spec"]["entrypoint"] == {"script": "train.py", "args": ["--x"]}
    assert job["name"] == "train" and "data" not in job["spec"]
    # A factory from the bundle in torchyard's own loop.
    loop = SPEC | {"code": {"bundle": bid}, "model": {"name": "pkg.net:build"}}
    assert client.post("/v1/jobs", json=loop, headers=coder).status_code == 201
    # Admins may run code, and name any bundle (they see every one).
    r = client.post("/v1/jobs", json=_script_spec(bid, "pkg/net.py"), headers=admin)
    assert r.status_code == 201, r.text


def test_token_create_can_run_code_grants_it(
    client: TestClient, app: Any, db_url: str, bundle: bytes,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from torchyard.settings import get_settings
    from torchyard.store.cli import token_main

    def token(*flags: str) -> Headers:
        assert token_main(["create", "--user", "dave", *flags]) == 0
        return {"Authorization": f"Bearer {capsys.readouterr().out.strip()}"}

    monkeypatch.setenv("TORCHYARD_DATABASE_URL", db_url)
    get_settings.cache_clear()
    try:
        plain = token()
        _error(_upload(client, plain, bundle), 403, "forbidden")
        spec = _script_spec("ab" * 32)
        _error(client.post("/v1/jobs", json=spec, headers=plain), 403, "forbidden")
        granted = token("--can-run-code")
        later = token()  # a token without the flag promotes nothing and takes nothing away
    finally:
        get_settings.cache_clear()
    app.state.token_cache.clear()  # the API caches a token's user for a few seconds
    bid = _upload(client, granted, bundle).json()["id"]
    for headers in (granted, later, plain):  # the permission is the user's, not the token's
        r = client.post("/v1/jobs", json=_script_spec(bid), headers=headers)
        assert r.status_code == 201, r.text


def test_an_unknown_or_foreign_bundle_is_422_on_code_bundle(
    client: TestClient, coder: Headers, bob: Headers, bundle: bytes
) -> None:
    foreign = _upload(client, bob, bundle).json()["id"]
    for bid in ("ab" * 32, foreign):
        r = client.post("/v1/jobs", json=_script_spec(bid), headers=coder)
        err = _error(r, 422, "validation_error")
        assert [d["field"] for d in err["details"]] == ["code.bundle"]
        assert f"no bundle {bid} of yours: upload it first" in err["message"]
    assert _count_jobs(client, coder) == 0


def test_an_entrypoint_script_not_in_the_bundle_is_422(
    client: TestClient, coder: Headers, bundle: bytes
) -> None:
    bid = _upload(client, coder, bundle).json()["id"]
    for script in ("missing.py", "pkg/train.py", "net.py"):
        r = client.post("/v1/jobs", json=_script_spec(bid, script), headers=coder)
        err = _error(r, 422, "validation_error")
        assert [d["field"] for d in err["details"]] == ["entrypoint.script"]
        assert repr(script) in err["message"] and "train.py" in err["message"]
    assert _count_jobs(client, coder) == 0


def test_a_bundle_gone_from_storage_is_422(
    client: TestClient, coder: Headers, bundle: bytes, settings: Settings
) -> None:
    bid = _upload(client, coder, bundle).json()["id"]
    (_bundle_dir(settings) / f"{bid}.tar.gz").unlink()
    r = client.post("/v1/jobs", json=_script_spec(bid), headers=coder)
    err = _error(r, 422, "validation_error")
    assert "upload it again" in err["message"]
    assert _upload(client, coder, bundle).status_code == 200  # which puts it back
    assert client.post("/v1/jobs", json=_script_spec(bid), headers=coder).status_code == 201


# -- init.from_job ---------------------------------------------------------------------------


def _init(job_id: str, checkpoint: Any = "latest") -> dict[str, Any]:
    return SPEC | {"init": {"from_job": job_id, "checkpoint": checkpoint}}


def _checkpoint(db_url: str, job_id: str, step: int, kind: str = "resume") -> None:
    suffix = "safetensors" if kind == "weights" else "pt"
    path = f"checkpoints/step-{step:08d}.{suffix}"
    with session_scope(db_url) as s:
        record_checkpoint(
            s, job_id, attempt=1, step=step, epoch=1.0, path=path, bytes=1, sha256="0" * 64,
            kind=kind,
        )  # fmt: skip


def _fields(r: Any) -> list[str]:
    return [d["field"] for d in _error(r, 422, "validation_error")["details"]]


def test_init_from_another_users_job_is_422(
    client: TestClient, factory: Factory, alice: Headers, admin: Headers, db_url: str
) -> None:
    theirs = factory.job("bob", state="succeeded")
    _checkpoint(db_url, theirs, 4, "weights")
    for job_id in (theirs, "e" * 32):
        r = client.post("/v1/jobs", json=_init(job_id), headers=alice)
        assert _fields(r) == ["init.from_job"]
        assert f"no job {job_id} of yours" in r.json()["error"]["message"]
    assert client.post("/v1/jobs", json=_init(theirs), headers=admin).status_code == 201
    assert _count_jobs(client, alice) == 0


def test_init_needs_the_checkpoint_it_names(
    client: TestClient, factory: Factory, alice: Headers, db_url: str
) -> None:
    mine = factory.job("alice", state="running")
    for checkpoint in ("latest", "weights", 2):
        assert _fields(client.post("/v1/jobs", json=_init(mine, checkpoint), headers=alice)) == [
            "init.checkpoint"
        ]
    _checkpoint(db_url, mine, 2)
    assert client.post("/v1/jobs", json=_init(mine), headers=alice).status_code == 201
    assert client.post("/v1/jobs", json=_init(mine, 2), headers=alice).status_code == 201
    r = client.post("/v1/jobs", json=_init(mine, 3), headers=alice)
    assert _fields(r) == ["init.checkpoint"] and "(steps: 2)" in r.json()["error"]["message"]
    assert _fields(client.post("/v1/jobs", json=_init(mine, "weights"), headers=alice)) == [
        "init.checkpoint"
    ]
    _checkpoint(db_url, mine, 4, "weights")
    assert client.post("/v1/jobs", json=_init(mine, "weights"), headers=alice).status_code == 201


def test_imagefolder_data_is_looked_for_on_disk(
    client: TestClient, alice: Headers, settings: Settings
) -> None:
    spec = SPEC | {"data": {"name": "imagefolder/pets", "image_size": 32}}
    r = client.post("/v1/jobs", json=spec, headers=alice)
    assert _fields(r) == ["data.name"] and "pets/train" in r.json()["error"]["message"]
    for split in ("train", "val"):
        (settings.data / "pets" / split).mkdir(parents=True)
    assert client.post("/v1/jobs", json=spec, headers=alice).status_code == 201


def test_a_script_sweep_cannot_be_paused_by_synchronous_halving(
    client: TestClient, alice: Headers, bundle: bytes
) -> None:
    """`pruner: halving` resumes a paused trial from torchyard's own checkpoint at the rung;
    a script keeps its own state, so such a sweep is refused, naming the pruner."""
    bid = _upload(client, alice, bundle).json()["id"]
    sweep = {
        "spec": _script_spec(bid),
        "space": {"entrypoint.args": {"type": "categorical", "choices": [["--a"], ["--b"]]}},
        "objective": {"metric": "val/score", "mode": "max"},
        "trials": 2,
        "pruner": "halving",
    }
    err = _error(client.post("/v1/sweeps", json=sweep, headers=alice), 422, "validation_error")
    (detail,) = err["details"]
    assert detail["field"] == "pruner" and "use asha or median" in detail["message"]
    r = client.post("/v1/sweeps", json=sweep | {"pruner": "asha"}, headers=alice)
    assert r.status_code == 201, r.text
