"""Data sets in the store (storage/datasets.py): published once as content-addressed blobs
and a manifest, pulled into a host's data root, every file checked against its sha256
before use, the marker's fast path, hostile folders and manifests refused, concurrent
pulls on one host yielding one good copy; the worker's `data_ready` and the submit check
over it; one publish and pull on the real SeaweedFS (two hosts, two data roots)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from seaweed import Seaweed

import torchyard.worker.inputs as inputs
from torchyard.scheduler import submitchecks
from torchyard.settings import Settings
from torchyard.storage import Storage
from torchyard.storage.datasets import (
    MARKER,
    DatasetRejected,
    dataset_folder,
    needs_files,
    publish_dataset,
    read_manifest,
    stored_datasets,
    sync_dataset,
)
from torchyard.storage.keys import dataset_blob_key, dataset_manifest_key
from torchyard.storage.local import LocalStorage
from torchyard.storage.memory import MemoryStorage

NAME = "imagefolder/pets"
FILES = {
    "train/cat/1.png": b"cat one",
    "train/cat/2.png": b"cat two",
    "train/dog/1.png": b"dog one",
    "val/cat/1.png": b"cat one",  # the same bytes as train/cat/1.png: one blob
    "val/dog/1.png": b"dog val",
}


class Counting(MemoryStorage):
    """MemoryStorage that counts reads and writes, per kind."""

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.calls: dict[str, int] = {}
        self._count_lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.calls[what] = self.calls.get(what, 0) + 1

    def open_read(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        self._count("open_read")
        return super().open_read(key, start, length)

    def read_range(self, key: str, start: int, limit: int) -> tuple[bytes, int]:
        self._count("read_range")
        return super().read_range(key, start, limit)

    def write_file(self, key: str, path: Path, **kw: Any) -> Any:
        self._count("write_file")
        return super().write_file(key, path, **kw)


@pytest.fixture
def store(tmp_path: Path) -> Counting:
    return Counting(tmp_path / "scratch")


def _tree(folder: Path, files: dict[str, bytes] = FILES) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def _files_under(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _leftovers(root: Path) -> list[str]:
    """Hidden entries of the data root other than lock files: staging or moved-aside
    folders a sync left behind."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))  # fmt: skip


def test_names_and_folders() -> None:
    assert needs_files("mnist") and needs_files("imagefolder/pets")
    assert not needs_files("digits") and not needs_files("synthetic")
    assert not needs_files("mymod:make") and not needs_files("imagefolder/../x")
    assert dataset_folder("mnist") == "MNIST"
    assert dataset_folder("fashion_mnist") == "FashionMNIST"
    assert dataset_folder("cifar10") == "cifar-10-batches-py"
    assert dataset_folder("imagefolder/pets") == "pets"
    with pytest.raises(DatasetRejected):
        dataset_folder("digits")
    assert dataset_manifest_key("imagefolder/pets") == "datasets/imagefolder/pets.json"


def test_publish_then_sync_round_trip(store: Counting, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    published = publish_dataset(store, NAME, src)
    assert published.key == "datasets/imagefolder/pets.json"
    assert (published.uploaded, published.present, published.unchanged) == (4, 0, False)
    manifest, _ = read_manifest(store, NAME) or (None, None)
    assert manifest is not None and manifest.folder == "pets"
    assert [e.path for e in manifest.files] == sorted(FILES)
    for e in manifest.files:
        assert e.sha256 == hashlib.sha256(FILES[e.path]).hexdigest()
        assert store.stat(dataset_blob_key(e.sha256)).size == e.size
    assert [m.name for m in stored_datasets(store)] == [NAME]

    root = tmp_path / "data"
    store.calls.clear()
    target = sync_dataset(store, NAME, root)
    assert target == root / "pets"
    assert _files_under(target) == FILES
    marker = json.loads((target / MARKER).read_text())
    assert marker["name"] == NAME and marker["files"] == len(FILES)
    # Readable by the sandbox's user, whatever the umask.
    assert stat.S_IMODE((target / "train" / "cat").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "val/dog/1.png").stat().st_mode) == 0o644
    assert _leftovers(root) == []
    # One fetch per distinct blob (the duplicate is copied locally), plus the manifest.
    assert store.calls["open_read"] == 4 and store.calls["read_range"] == 1


def test_a_name_the_store_lacks_is_left_to_the_data_root(store: Counting, tmp_path: Path) -> None:
    root = _tree(tmp_path / "data" / "pets").parent
    assert sync_dataset(store, NAME, root) is None
    assert _files_under(root / "pets") == FILES  # untouched


def test_republishing_uploads_nothing_and_a_change_needs_force(
    store: Counting, tmp_path: Path
) -> None:
    src = _tree(tmp_path / "src")
    publish_dataset(store, NAME, src)
    before = store.calls["write_file"]
    again = publish_dataset(store, NAME, src)
    assert (again.uploaded, again.present, again.unchanged) == (0, 4, True)
    assert store.calls["write_file"] == before  # no blob sent twice
    (src / "val/dog/1.png").write_bytes(b"dog val, new")
    with pytest.raises(DatasetRejected, match=r"different 'imagefolder/pets'.*--force"):
        publish_dataset(store, NAME, src)
    changed = publish_dataset(store, NAME, src, force=True)
    assert (changed.uploaded, changed.present, changed.unchanged) == (1, 3, False)
    assert store.calls["write_file"] == before + 1


def test_the_marker_is_the_fast_path_and_a_new_version_replaces_the_old(
    store: Counting, tmp_path: Path
) -> None:
    src = _tree(tmp_path / "src")
    publish_dataset(store, NAME, src)
    root = tmp_path / "data"
    sync_dataset(store, NAME, root)
    store.calls.clear()
    assert sync_dataset(store, NAME, root) == root / "pets"
    assert store.calls == {}  # one stat of the manifest: no read at all
    # A new version: the host's copy becomes it, the old file gone, nothing left aside.
    (src / "train/dog/1.png").unlink()
    (src / "train/dog/2.png").write_bytes(b"dog two")
    publish_dataset(store, NAME, src, force=True)
    sync_dataset(store, NAME, root)
    assert _files_under(root / "pets") == _files_under(src)
    assert not (root / "pets/train/dog/1.png").exists()
    assert store.calls["open_read"] == 1  # only the new blob
    assert _leftovers(root) == []


def test_a_blob_that_does_not_match_its_sha256_is_refused_and_nothing_is_installed(
    store: Counting, tmp_path: Path
) -> None:
    src = _tree(tmp_path / "src")
    publish_dataset(store, NAME, src)
    root = tmp_path / "data"
    sha = hashlib.sha256(b"dog val").hexdigest()
    store.write_bytes(dataset_blob_key(sha), b"dog VAL")  # same size, other bytes
    with pytest.raises(DatasetRejected, match=r"val/dog/1.png .* does not match its sha256"):
        sync_dataset(store, NAME, root)
    assert not (root / "pets").exists() and _leftovers(root) == []
    # A good copy already there is kept when the next version is bad.
    store.write_bytes(dataset_blob_key(sha), b"dog val")
    sync_dataset(store, NAME, root)
    (src / "val/dog/1.png").write_bytes(b"dog val 2")
    publish_dataset(store, NAME, src, force=True)
    store.delete(dataset_blob_key(hashlib.sha256(b"dog val 2").hexdigest()))
    with pytest.raises(DatasetRejected, match="is missing from the store"):
        sync_dataset(store, NAME, root)
    assert (root / "pets/val/dog/1.png").read_bytes() == b"dog val" and _leftovers(root) == []


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"folder": "../etc"}, "its folder '../etc' is not imagefolder/pets's"),
        ({"name": "imagefolder/other"}, "it names 'imagefolder/other'"),
        ({"files": [{"path": "../../x", "size": 1, "sha256": "0" * 64}]}, "refused file path"),
        ({"files": [{"path": MARKER, "size": 1, "sha256": "0" * 64}]}, "refused file path"),
        ({"files": [{"path": "a", "size": 1, "sha256": "0" * 64},
                    {"path": "a/b", "size": 1, "sha256": "0" * 64}]}, "as a file and a folder"),
        ({"files": [{"path": "a", "size": -1, "sha256": "0" * 64}]}, "bad size"),
        ({"files": [{"path": "a", "size": 1, "sha256": "x"}]}, "bad sha256"),
        ({"files": []}, "lists no files"),
    ],
)  # fmt: skip
def test_a_hostile_manifest_is_refused_before_any_file_is_written(
    store: Counting, tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    body = {"name": NAME, "folder": "pets", "created": "now",
            "files": [{"path": "train/a/1.png", "size": 1, "sha256": "0" * 64}]} | change  # fmt: skip
    store.write_bytes(dataset_manifest_key(NAME), json.dumps(body).encode())
    root = tmp_path / "data"
    with pytest.raises(DatasetRejected, match=words):
        sync_dataset(store, NAME, root)
    assert not root.exists() or [p.name for p in root.iterdir()] == []
    assert not (tmp_path / "x").exists()


def test_links_and_special_files_in_the_folder_are_refused(store: Counting, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (tmp_path / "secret").write_bytes(b"not for the store")
    (src / "train/cat/3.png").symlink_to(tmp_path / "secret")
    with pytest.raises(DatasetRejected, match=r"3\.png: a symbolic link"):
        publish_dataset(store, NAME, src)
    (src / "train/cat/3.png").unlink()
    (src / "val/dog").rename(src / "val/dog-real")
    (src / "val/dog").symlink_to(src / "val/dog-real")
    with pytest.raises(DatasetRejected, match="val/dog: a symbolic link"):
        publish_dataset(store, NAME, src)
    (src / "val/dog").unlink()
    os.mkfifo(src / "train/cat/pipe.png")
    with pytest.raises(DatasetRejected, match=r"pipe\.png: not a regular file"):
        publish_dataset(store, NAME, src)
    assert list(store.list("datasets")) == []  # nothing stored, not even a blob
    with pytest.raises(DatasetRejected, match="built-in data set"):
        publish_dataset(store, "imagefolder/MNIST", src)


def test_concurrent_syncs_in_threads_make_one_copy(store: Counting, tmp_path: Path) -> None:
    publish_dataset(store, NAME, _tree(tmp_path / "src"))
    root = tmp_path / "data"
    results: list[Path | None] = []
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def pull() -> None:
        go.wait()
        try:
            results.append(sync_dataset(store, NAME, root))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [root / "pets"] * 8
    assert _files_under(root / "pets") == FILES and _leftovers(root) == []
    assert store.calls["open_read"] == 4  # fetched once: the others waited and found it


def _pull_in_process(store_root: str, data_root: str, out: Any) -> None:
    try:
        got = sync_dataset(LocalStorage(Path(store_root)), NAME, Path(data_root))
        out.put(str(got))
    except BaseException as e:  # reported to the parent
        out.put(repr(e))


def test_concurrent_syncs_in_processes_make_one_copy(tmp_path: Path) -> None:
    """Several worker processes of one host (here over a file store): the lock file keeps
    them apart, and every one of them ends with the same good copy."""
    shared = LocalStorage(tmp_path / "store")
    files = {f"train/c{i % 3}/{i}.png": os.urandom(20_000) for i in range(30)}
    files |= {f"val/c{i}/v.png": os.urandom(100) for i in range(3)}
    publish_dataset(shared, NAME, _tree(tmp_path / "src", files))
    root = tmp_path / "data"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pull_in_process, args=(str(shared.root), str(root), out))
             for _ in range(4)]  # fmt: skip
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert got == [str(root / "pets")] * 4
    assert _files_under(root / "pets") == files and _leftovers(root) == []


# ---------------------------------------------------------------- the worker and the API


@pytest.fixture
def mem_settings(tmp_path: Path) -> Settings:
    return Settings(_env_file=None, home=tmp_path / "home", storage_url="memory://",  # type: ignore[call-arg]
                    data_root=tmp_path / "data")  # fmt: skip


def test_data_ready_pulls_the_jobs_set_and_fails_the_job_on_a_bad_file(
    mem_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Counting(tmp_path / "scratch")
    monkeypatch.setattr(inputs, "storage_for", lambda _settings: storage)
    spec: dict[str, Any] = {"data": {"name": NAME}}
    assert inputs.data_ready(mem_settings, spec) is None  # not in the store: as before
    publish_dataset(storage, NAME, _tree(tmp_path / "src"))
    assert inputs.data_ready(mem_settings, {"data": {"name": "digits"}}) is None
    assert inputs.data_ready(mem_settings, spec) == mem_settings.data / "pets"
    assert _files_under(mem_settings.data / "pets") == FILES
    # Another host, a damaged blob: the job's problem, not retried.
    other = mem_settings.model_copy(update={"data_root": tmp_path / "other"})
    storage.write_bytes(dataset_blob_key(hashlib.sha256(b"dog one").hexdigest()), b"dog two")
    with pytest.raises(inputs.InputError, match="does not match its sha256"):
        inputs.data_ready(other, spec)
    # A store out of reach is an OSError (the attempt is retried), not an InputError.
    monkeypatch.setattr(storage, "stat", lambda key: (_ for _ in ()).throw(OSError("down")))
    with pytest.raises(OSError, match="down"):
        inputs.data_ready(other, spec)
    # The file backend: the data root is the admin's, nothing is pulled.
    local = Settings(_env_file=None, home=tmp_path / "h2", data_root=tmp_path / "d2")  # type: ignore[call-arg]
    monkeypatch.setattr(inputs, "storage_for", lambda _s: LocalStorage(tmp_path / "st"))
    assert inputs.data_ready(local, spec) is None


def test_the_submit_check_counts_a_set_in_the_store(
    mem_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = MemoryStorage(tmp_path / "scratch")
    monkeypatch.setattr(submitchecks, "storage_for", lambda _settings: storage)
    (problem,) = submitchecks.place_problems(mem_settings, NAME, 1)
    assert problem[0] == "data.name"
    assert "data set 'imagefolder/pets' is not on the server; looked for " in problem[1]
    assert "memory://datasets/imagefolder/pets.json" in problem[1]
    assert "`torchyard data upload DIR --name pets`" in problem[1]
    (problem,) = submitchecks.place_problems(mem_settings, "mnist", 1)
    assert "`torchyard data import mnist FILE…`" in problem[1]
    publish_dataset(storage, NAME, _tree(tmp_path / "src"))
    assert submitchecks.place_problems(mem_settings, NAME, 1) == []
    assert submitchecks.place_problems(mem_settings, "mnist", 1) != []


# ---------------------------------------------------------------- the real object store


def test_publish_and_pull_through_seaweedfs(
    s3_server: Seaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchyard.storage.s3 import S3Storage

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket, prefix = s3_server.make_bucket(), f"ds/{uuid.uuid4().hex}"

    def host(name: str) -> Storage:
        return S3Storage(bucket, prefix, cache=tmp_path / f"cache-{name}",
                         endpoint_url=s3_server.endpoint_url)  # fmt: skip

    big = {"raw/train-images-idx3-ubyte": os.urandom(3 << 20), **{f"raw/f{i}": b"x" * i for i in range(3)}}  # fmt: skip
    published = publish_dataset(host("admin"), "mnist", _tree(tmp_path / "MNIST", big))
    assert published.uploaded == 4 and published.key == "datasets/mnist.json"
    stored = host("admin").stat(dataset_blob_key(hashlib.sha256(b"x").hexdigest()))
    assert stored.sha256 == hashlib.sha256(b"x").hexdigest()  # the store recorded it
    for name in ("a", "b"):
        root = tmp_path / f"data-{name}"
        assert sync_dataset(host(name), "mnist", root) == root / "MNIST"
        assert _files_under(root / "MNIST") == big
        assert sync_dataset(host(name), "mnist", root) == root / "MNIST"  # the fast path
    again = publish_dataset(host("admin"), "mnist", _tree(tmp_path / "MNIST", big))
    assert (again.uploaded, again.present, again.unchanged) == (0, 4, True)
