"""`torchyard data import`: official archives (here tiny ones with the official names and the
official formats, their checksums patched into the table: nothing is downloaded) are checked,
unpacked in torchvision's layout atomically, and refused with a clear message when they are
not the right files."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.imagefolders import PNG, make_imagefolder

from torchyard.cli import main as torchyard_main
from torchyard.contracts.datasets import missing_dataset_files
from torchyard.store import dataimport
from torchyard.store.dataimport import IMPORTS, data_main

REPO = Path(__file__).resolve().parents[2]
IDX_NAMES = list(IMPORTS["mnist"].archives)
CIFAR_MEMBERS = list(IMPORTS["cifar10"].members)


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _idx(count: int, *dims: int) -> bytes:
    header = bytes([0, 0, 8, 1 + len(dims)])
    header += b"".join(d.to_bytes(4, "big") for d in (count, *dims))
    return header + bytes(count * (dims[0] * dims[1] if dims else 1))


def _mnist_files(folder: Path) -> dict[str, bytes]:
    """The four official file names, gzipped idx content; returns name -> plain bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = {
        "train-images-idx3-ubyte.gz": _idx(6, 28, 28),
        "train-labels-idx1-ubyte.gz": _idx(6),
        "t10k-images-idx3-ubyte.gz": _idx(2, 28, 28),
        "t10k-labels-idx1-ubyte.gz": _idx(2),
    }
    for name, data in plain.items():
        (folder / name).write_bytes(gzip.compress(data, mtime=0))
    return plain


@pytest.fixture
def mnist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, bytes]]:
    """Tiny MNIST files in `downloads/`, the table patched to their checksums."""
    folder = tmp_path / "downloads"
    plain = _mnist_files(folder)
    sums = {n: _md5((folder / n).read_bytes()) for n in plain}
    monkeypatch.setitem(IMPORTS, "mnist", dataclasses.replace(IMPORTS["mnist"], archives=sums))
    return folder, plain


def _cifar_archive(path: Path, extra: list[tarfile.TarInfo] | None = None) -> dict[str, bytes]:
    """cifar-10-python.tar.gz as the official one is laid out (with its readme.html)."""
    batch = {b"data": bytes(3072 * 2), b"labels": [1, 2]}
    content = {m: pickle.dumps(batch) for m in CIFAR_MEMBERS}
    content["batches.meta"] = pickle.dumps({b"label_names": [b"airplane"] * 10})
    content["readme.html"] = b"<html></html>"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in content.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return content


def _patch_cifar(monkeypatch: pytest.MonkeyPatch, archive: Path, content: dict[str, bytes]) -> None:
    spec = dataclasses.replace(
        IMPORTS["cifar10"],
        archives={archive.name: _md5(archive.read_bytes())},
        members={m: _md5(content[m]) for m in CIFAR_MEMBERS},
    )
    monkeypatch.setitem(IMPORTS, "cifar10", spec)


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def test_mnist_is_unpacked_in_torchvisions_layout(
    tmp_path: Path, mnist: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, plain = mnist
    root = tmp_path / "data"
    files = [str(folder / n) for n in IDX_NAMES]
    assert data_main(["--data-root", str(root), "import", "mnist", *files]) == 0
    raw = root / "MNIST" / "raw"
    for name, data in plain.items():
        assert (raw / name.removesuffix(".gz")).read_bytes() == data
    assert missing_dataset_files("mnist", root) == []
    assert "checksums match torchvision's" in capsys.readouterr().out
    assert _leftovers(root) == []  # no temporary folder left behind


def test_a_folder_holding_the_files_will_do_and_force_replaces(
    tmp_path: Path, mnist: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _ = mnist
    root = tmp_path / "data"
    argv = ["--data-root", str(root), "import", "mnist", str(folder)]
    assert data_main(argv) == 0
    (root / "MNIST" / "raw" / "stale").write_text("from before")
    assert data_main(argv) == 2
    assert "already exists: --force replaces it" in capsys.readouterr().err
    assert data_main([*argv, "--force"]) == 0
    assert not (root / "MNIST" / "raw" / "stale").exists()
    assert missing_dataset_files("mnist", root) == [] and _leftovers(root) == []


def test_a_wrong_checksum_is_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real table: tiny files are not the official ones."""
    folder = tmp_path / "downloads"
    _mnist_files(folder)
    root = tmp_path / "data"
    assert data_main(["--data-root", str(root), "import", "mnist", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "torchvision's published checksum is f68b3c2dcbeaaa9fbdd348bbdeb94873" in err
    assert not root.exists() or list(root.rglob("*")) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["imagenet", "x.tar"], "cannot import 'imagenet': one of mnist, fashion_mnist, cifar10"),
        (["digits", "x.tar"], "'digits' needs no files: it comes with scikit-learn"),
        (["mnist", "{d}/train-images-idx3-ubyte.gz"], "mnist needs train-labels-idx1-ubyte.gz"),
        (["mnist", "{d}", "{d}/notes.txt"], "notes.txt: not one of mnist's official files"),
        (["mnist", "{d}", "{d}/t10k-labels-idx1-ubyte.gz"], "t10k-labels-idx1-ubyte.gz is given twice"),
        (["cifar10", "{d}/cifar-10-python.tar.gz"], "cifar-10-python.tar.gz: no such file"),
    ],
)  # fmt: skip
def test_wrong_names_and_missing_files_are_refused(
    tmp_path: Path,
    mnist: tuple[Path, dict[str, bytes]],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    folder, _ = mnist
    (folder / "notes.txt").write_text("x")
    args = [a.format(d=folder) for a in argv]
    assert data_main(["--data-root", str(tmp_path / "data"), "import", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data").exists() or list((tmp_path / "data").rglob("*")) == []


def test_cifar10_takes_its_own_members_and_checks_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    content = _cifar_archive(archive)
    _patch_cifar(monkeypatch, archive, content)
    root = tmp_path / "data"
    assert (
        torchyard_main(["data", "--data-root", str(root), "import", "cifar10", str(archive)]) == 0
    )
    folder = root / "cifar-10-batches-py"
    assert sorted(p.name for p in folder.iterdir()) == sorted(CIFAR_MEMBERS)  # no readme
    assert (folder / "data_batch_3").read_bytes() == content["data_batch_3"]
    assert missing_dataset_files("cifar10", root) == [] and _leftovers(root) == []
    # A member that is not what torchvision published is refused, and nothing stays.
    bad = dataclasses.replace(IMPORTS["cifar10"], members={**IMPORTS["cifar10"].members,
                                                           "test_batch": "0" * 32})  # fmt: skip
    monkeypatch.setitem(IMPORTS, "cifar10", bad)
    with pytest.raises(dataimport.ImportRefused, match=r"test_batch: MD5 .* published"):
        dataimport.import_dataset("cifar10", [archive], tmp_path / "other")
    assert list((tmp_path / "other").rglob("*")) == []


def _link(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def test_a_hostile_archive_writes_nothing_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members outside the set's folder are never extracted; a member of the set that is a
    link is refused (its checksum would not save us: MD5 collisions can be made)."""
    outside = tarfile.TarInfo("../../evil.txt")
    outside.size = 4
    archive = tmp_path / "cifar-10-python.tar.gz"
    content = _cifar_archive(archive, [outside, _link("cifar-10-batches-py/x", "/etc/passwd")])
    _patch_cifar(monkeypatch, archive, content)
    root = tmp_path / "deep" / "data"
    dataimport.import_dataset("cifar10", [archive], root)
    assert not (tmp_path / "evil.txt").exists() and not (root.parent / "evil.txt").exists()
    assert not (root / "cifar-10-batches-py" / "x").exists()

    archive.unlink()
    linked = [_link("cifar-10-batches-py/data_batch_1", "/etc/passwd")]
    content = _cifar_archive(archive, linked)  # a second data_batch_1: a link
    _patch_cifar(monkeypatch, archive, content)
    with pytest.raises(dataimport.ImportRefused, match="data_batch_1 is not a data file"):
        dataimport.import_dataset("cifar10", [archive], tmp_path / "other")
    assert list((tmp_path / "other").rglob("*")) == []


def test_list_says_what_the_data_root_holds(
    tmp_path: Path, mnist: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    data_main(["--data-root", str(root), "import", "mnist", str(mnist[0])])
    capsys.readouterr()
    assert data_main(["--data-root", str(root), "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "mnist" and lines[0].endswith(": present")
    assert "missing train-images-idx3-ubyte, " in lines[1]
    assert "cifar-10-batches-py: missing " in lines[2] and lines[2].endswith(", batches.meta")


def test_the_module_does_not_load_torch() -> None:
    code = "import sys, torchyard.store.dataimport; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- data upload (ImageFolder)


def test_upload_copies_an_imagefolder_set_into_the_data_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_imagefolder(tmp_path / "pets")
    root = tmp_path / "data"
    argv = ["--data-root", str(root), "upload", str(src), "--name", "pets"]
    assert data_main(argv) == 0
    assert f"imagefolder/pets: copied into {root / 'pets'}" in capsys.readouterr().out
    assert (root / "pets/val/dog/val-dog.png").read_bytes() == PNG + b"dog"
    assert missing_dataset_files("imagefolder/pets", root) == [] and _leftovers(root) == []
    assert (root / "pets/train/cat").stat().st_mode & 0o777 == 0o755
    assert data_main(argv) == 2
    assert "already exists: --force replaces it" in capsys.readouterr().err
    (src / "train/cat/more.png").write_bytes(PNG)
    assert data_main([*argv, "--force"]) == 0
    assert (root / "pets/train/cat/more.png").is_file() and _leftovers(root) == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: shutil.rmtree(d / "val"), "no val/ folder"),
        (lambda d: shutil.rmtree(d / "val/dog"), "train/ has classes ['cat', 'dog'], val/ ['cat']"),
        (lambda d: (d / "train/dog/train-dog.png").rename(d / "train/dog/x.txt"), "no images"),
        (lambda d: (d / "train/cat/link.png").symlink_to("/etc/passwd"), "link.png: a symbolic link"),
        (lambda d: os.mkfifo(d / "val/cat/p.png"), "p.png: not a regular file"),
    ],
)  # fmt: skip
def test_upload_refuses_what_the_trainer_could_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, message: str
) -> None:
    src = make_imagefolder(tmp_path / "pets")
    damage(src)
    root = tmp_path / "data"
    assert data_main(["--data-root", str(root), "upload", str(src), "--name", "pets"]) == 2
    assert message in capsys.readouterr().err
    assert not root.exists() or list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [("../x", "--name '../x': letters, digits"), ("MNIST", "a built-in data set's folder")],
)
def test_upload_refuses_bad_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    src = make_imagefolder(tmp_path / "pets")
    argv = ["--data-root", str(tmp_path / "data"), "upload", str(src), "--name", name]
    assert data_main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["data", "--data-root", "{root}", "upload", "{src}", "--name", "pets"],  # README's
        ["data", "upload", "{src}", "--name", "pets", "--data-root", "{root}"],  # was refused
        ["data", "upload", "--data-root={root}", "{src}", "--name", "pets"],
    ],
)
def test_data_root_is_accepted_before_and_after_the_action(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """Issue 44: `data upload … --data-root DIR` (where the help put it) was a usage error."""
    src, root = make_imagefolder(tmp_path / "pets"), tmp_path / "data"
    argv = [a.format(root=root, src=src) for a in argv]
    assert torchyard_main(argv) == 0, capsys.readouterr().err
    assert (root / "pets/train/cat/train-cat.png").is_file()
    assert data_main(["list", "--data-root", str(root)]) == 0


def test_list_shows_imagefolder_sets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: `data list` named only the torchvision sets, never an uploaded one."""
    root, src = tmp_path / "data", make_imagefolder(tmp_path / "pets")
    assert data_main(["--data-root", str(root), "upload", str(src), "--name", "pets"]) == 0
    (root / "notaset").mkdir()  # no train/ and val/: not listed
    capsys.readouterr()
    assert data_main(["--data-root", str(root), "list"]) == 0
    out = capsys.readouterr().out
    assert f"imagefolder/pets {root / 'pets'}: present (2 classes)" in out
    assert "notaset" not in out


# ---------------------------------------------------------------- with an object store


@pytest.fixture
def object_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """TORCHYARD_STORAGE_URL=memory:// (an object store with no local paths): the storage
    the command sees."""
    from torchyard.settings import get_settings
    from torchyard.storage import storage_for

    monkeypatch.setenv("TORCHYARD_STORAGE_URL", "memory://")
    monkeypatch.setenv("TORCHYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHYARD_DATA_ROOT", str(tmp_path / "admin-data"))
    get_settings.cache_clear()
    yield storage_for(get_settings())
    get_settings.cache_clear()


def test_import_publishes_to_the_object_store_and_a_host_pulls_it(
    tmp_path: Path,
    mnist: tuple[Path, dict[str, bytes]],
    object_store: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torchyard.storage.datasets import read_manifest, sync_dataset

    folder, plain = mnist
    assert data_main(["import", "mnist", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "mnist: checksums match torchvision's; stored: datasets/mnist.json (4 files" in out
    assert "4 uploaded, 0 already there" in out
    assert not (tmp_path / "admin-data").exists()  # the store, not this host's data root
    manifest, _ = read_manifest(object_store, "mnist")
    assert manifest.folder == "MNIST"
    assert sorted(e.path for e in manifest.files) == sorted(
        f"raw/{n.removesuffix('.gz')}" for n in plain
    )
    host = tmp_path / "host-data"
    assert sync_dataset(object_store, "mnist", host) == host / "MNIST"
    assert missing_dataset_files("mnist", host) == []
    for name, data in plain.items():
        assert (host / "MNIST/raw" / name.removesuffix(".gz")).read_bytes() == data
    # Again: nothing uploaded, the manifest kept (hosts keep their copies).
    assert data_main(["import", "mnist", str(folder)]) == 0
    assert "already in the store, unchanged" in capsys.readouterr().out
    assert list((object_store.staging_dir("datasets")).iterdir()) == []  # no staging left
    # --local: this host's data root, as without a store.
    assert data_main(["--local", "import", "mnist", str(folder)]) == 0
    assert missing_dataset_files("mnist", tmp_path / "admin-data") == []


def test_upload_and_list_with_the_object_store(
    tmp_path: Path, object_store: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_imagefolder(tmp_path / "pets")
    assert data_main(["upload", str(src), "--name", "pets"]) == 0
    assert "imagefolder/pets: stored: datasets/imagefolder/pets.json (4 files" in (
        capsys.readouterr().out
    )
    assert object_store.exists("datasets/imagefolder/pets.json")
    (src / "val/cat/val-cat.png").write_bytes(PNG + b"other")
    assert data_main(["upload", str(src), "--name", "pets"]) == 2
    assert "different 'imagefolder/pets'" in capsys.readouterr().err
    assert data_main(["upload", str(src), "--name", "pets", "--force"]) == 0
    # train/cat and val/cat held the same bytes (one blob); now four distinct ones.
    assert "1 uploaded, 2 already there" in capsys.readouterr().out
    assert data_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == "in the object store (memory://datasets):"
    assert lines[4].startswith("imagefolder/pets 4 files, ")
    assert len(lines) == 5
