"""`torchyard data upload DIR --name NAME` over the API (issue 44, bug 3): run from any work
folder, the set lands in the server's data root (where its jobs read it), never in the work
folder's `./.torchyard/data`; hostile names, archives and users are refused with a 4xx that
names the field."""

from __future__ import annotations

import functools
import io
import os
import tarfile
from pathlib import Path

import pytest
from client_server import Run, Store
from fastapi.testclient import TestClient
from support.imagefolders import PNG, make_imagefolder

from torchyard.api.app import create_app
from torchyard.cli import main as torchyard_main
from torchyard.client import cli as client_cli
from torchyard.settings import Settings


def _tar_gz(add: list[tarfile.TarInfo], files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in add:
            tar.addfile(info)
    return buf.getvalue()


GOOD = {f"{s}/{c}/{s}-{c}.png": PNG for s in ("train", "val") for c in ("cat", "dog")}


def _post(http: TestClient, token: str, body: bytes, name: str = "pets", **params: str) -> dict:
    resp = http.post(
        "/v1/datasets",
        params={"name": name, **params},
        content=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/gzip"},
    )
    return {"status": resp.status_code, **resp.json()}


def test_upload_from_a_work_folder_lands_in_the_servers_data_root(
    tmp_path: Path,
    http: TestClient,
    root: str,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The whole `torchyard data upload` (its dispatcher included) from a work folder: before
    the fix it copied into the CLI's own `.torchyard/data` and printed success."""
    src = make_imagefolder(tmp_path / "incoming" / "flowers")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("TORCHYARD_HOME")  # the CLI's settings default to ./.torchyard
    monkeypatch.setenv("TORCHYARD_TOKEN", root)
    monkeypatch.setattr(client_cli, "main", functools.partial(client_cli.main, http=http))
    assert torchyard_main(["data", "upload", str(src), "--name", "flowers"]) == 0
    out = capsys.readouterr().out
    assert "imagefolder/flowers: 4 files, classes cat, dog; on the server in " in out
    assert (settings.data / "flowers/val/dog/val-dog.png").read_bytes() == PNG + b"dog"
    assert not (work / ".torchyard").exists()
    assert sorted(p.name for p in settings.data.iterdir()) == ["flowers"]  # no staging left


def test_existing_set_needs_force_and_bad_input_names_its_field(
    tmp_path: Path, run: Run, settings: Settings
) -> None:
    src = make_imagefolder(tmp_path / "pets")
    assert run("data", "upload", str(src), "--name", "pets")[0] == 0
    rc, _, err = run("data", "upload", str(src), "--name", "pets")
    assert rc == 1 and "imagefolder/pets is on the server already: force replaces it" in err
    (src / "train/cat/more.png").write_bytes(PNG)
    assert run("data", "upload", str(src), "--name", "pets", "--force")[0] == 0
    assert (settings.data / "pets/train/cat/more.png").is_file()
    rc, _, err = run("data", "upload", str(src), "--name", "../x")
    assert rc == 2 and "name: '../x': letters, digits" in err
    (src / "val/dog").rename(src / "val/cow")
    rc, _, err = run("data", "upload", str(src), "--name", "other")
    assert rc == 2 and "body: the archive: train/ has classes ['cat', 'dog'], val/" in err
    (src / "train/cat/link.png").symlink_to("/etc/passwd")
    rc, _, err = run("data", "upload", str(src), "--name", "other")
    assert rc == 2 and "link.png: a symbolic link" in err
    assert sorted(p.name for p in settings.data.iterdir()) == ["pets"]


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("links", "extra", "message"),
    [
        ([_link("train/cat/in.png", "../dog/train-dog.png")], {}, "'train/cat/in.png': not a "),
        ([_link("train/cat/h.png", "val/cat/val-cat.png", tarfile.LNKTYPE)], {}, "'train/cat/h.png'"),
        ([_link("train/cat/out.png", "/etc/passwd")], {}, "train/cat/out.png"),
        ([], {"../escape.png": PNG}, "../escape.png"),
        ([], {"/abs/x.png": PNG}, "/abs/x.png"),
    ],
)  # fmt: skip
def test_hostile_archives_are_refused_naming_the_member(
    http: TestClient,
    root: str,
    settings: Settings,
    links: list[tarfile.TarInfo],
    extra: dict[str, bytes],
    message: str,
) -> None:
    got = _post(http, root, _tar_gz(links, {**GOOD, **extra}))
    assert got["status"] == 422, got
    assert got["error"]["details"][0]["field"] == "body"
    assert message in got["error"]["details"][0]["message"]
    assert not settings.data.exists() or list(settings.data.iterdir()) == []
    assert not (settings.data.parent / "escape.png").exists()


def test_only_admins_upload_and_size_is_limited(
    store: Store, settings: Settings, root: str
) -> None:
    small = settings.model_copy(update={"max_dataset_upload_bytes": 2048})
    with TestClient(create_app(small)) as http:
        user = store.token("bob")
        assert _post(http, user, _tar_gz([], GOOD))["status"] == 403
        big = _tar_gz([], {**GOOD, "train/cat/big.png": os.urandom(8192)})  # incompressible
        got = _post(http, root, big)
        assert (
            got["status"] == 413 and "TORCHYARD_MAX_DATASET_UPLOAD_BYTES" in got["error"]["message"]
        )
        assert _post(http, root, _tar_gz([], GOOD))["status"] == 201
        unauthenticated = http.post("/v1/datasets", params={"name": "x"}, content=b"")
        assert unauthenticated.status_code == 401
