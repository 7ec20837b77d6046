"""End to end: a data set published to the object store (real SeaweedFS) by `torchyard data
import` trains on a worker "host" whose data root was empty. The API, the admin and the
host each have their own TORCHYARD_HOME, storage root (a cache) and TORCHYARD_DATA_ROOT:
nothing but PostgreSQL, Redis and the store is shared.

The submit is accepted because the store has the set (the API's data root has nothing);
the worker pulls it into its own data root before the trainer starts, checked against each
file's sha256, and leaves its marker there; a second job on that host finds it in place. A
data set the store lacks is refused at submit, naming how to add it."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.worker_cluster import Cluster, s3_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.redis]

# A few steps on a tiny MNIST-format set (64 training images, 16 test).
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"name": "mnist"},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "batch_size": 16,
    "epochs": 2,
    "log_every_steps": 2,
    "seed": 3,
}


def _idx(count: int, *dims: int, fill: int = 0) -> bytes:
    """An idx file (MNIST's format): a header, then `count` samples of `dims` bytes."""
    header = bytes([0, 0, 8, 1 + len(dims)])
    header += b"".join(d.to_bytes(4, "big") for d in (count, *dims))
    per = dims[0] * dims[1] if dims else 1
    return header + bytes(
        (i * 7 + fill) % 10 if not dims else (i % 251) for i in range(count * per)
    )


def _mnist_downloads(folder: Path) -> dict[str, bytes]:
    """MNIST's four official file names, gzipped; returns name -> unpacked bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = {
        "train-images-idx3-ubyte.gz": _idx(64, 28, 28),
        "train-labels-idx1-ubyte.gz": _idx(64),
        "t10k-images-idx3-ubyte.gz": _idx(16, 28, 28),
        "t10k-labels-idx1-ubyte.gz": _idx(16, fill=3),
    }
    for name, data in plain.items():
        (folder / name).write_bytes(gzip.compress(data, mtime=0))
    return plain


class Host:
    def __init__(self, c: Cluster, root: Path, name: str) -> None:
        self.data = root / "data"
        env = {
            "TORCHYARD_HOME": str(root / "home"),
            "TORCHYARD_STORAGE_ROOT": str(root / "cache"),
            "TORCHYARD_DATA_ROOT": str(self.data),
        }
        c.start_worker(name, env)


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, s3_server: Any
) -> Iterator[tuple[Cluster, dict[str, str], Path]]:
    tmp = tmp_path_factory.mktemp("s3-datasets")
    extra = {"TORCHYARD_DATA_ROOT": str(tmp / "api-data")}
    with s3_cluster(request, tmp, s3_server, extra) as (c, env):
        yield c, env, tmp


def test_a_set_imported_to_the_store_trains_on_a_host_with_an_empty_data_root(
    cluster: tuple[Cluster, dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchyard.settings import get_settings
    from torchyard.store import dataimport

    c, env, tmp = cluster
    # The admin, on a machine of its own, imports the official files (tiny ones here, the
    # checksum table patched to them) into the store.
    downloads = tmp / "downloads"
    plain = _mnist_downloads(downloads)
    sums = {n: hashlib.md5((downloads / n).read_bytes()).hexdigest() for n in plain}
    mnist = dataclasses.replace(dataimport.IMPORTS["mnist"], archives=sums)
    monkeypatch.setitem(dataimport.IMPORTS, "mnist", mnist)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHYARD_HOME", str(tmp / "admin"))
    monkeypatch.setenv("TORCHYARD_DATA_ROOT", str(tmp / "admin" / "data"))
    get_settings.cache_clear()
    try:
        assert dataimport.data_main(["import", "mnist", str(downloads)]) == 0
    finally:
        get_settings.cache_clear()
    assert not (tmp / "admin" / "data").exists() and not (tmp / "api-data" / "MNIST").exists()

    # A set the store lacks is refused at submit, naming the fix.
    r = c.http.post("/v1/jobs", json=SPEC | {"data": {"name": "fashion_mnist"}})
    assert r.status_code == 422, r.text
    assert "torchyard data import fashion_mnist" in r.text

    host = Host(c, tmp / "host-a", "a")
    c.wait_workers(1)
    assert not host.data.exists() or list(host.data.iterdir()) == []
    job = c.submit(SPEC)
    done = c.wait_state(job["id"], "succeeded", timeout=180)
    assert done["progress"]["total_steps"] == 8
    raw = host.data / "MNIST" / "raw"
    for name, data in plain.items():
        assert (raw / name.removesuffix(".gz")).read_bytes() == data
    marker = json.loads((host.data / "MNIST" / ".torchyard-dataset.json").read_text())
    assert marker["name"] == "mnist" and marker["files"] == 4
    assert (raw.stat().st_mode & 0o777) == 0o755

    # A second job on the host: the copy is in place (the marker is not rewritten).
    stamp = (host.data / "MNIST" / ".torchyard-dataset.json").stat().st_mtime_ns
    second = c.submit(SPEC | {"seed": 4})
    c.wait_state(second["id"], "succeeded", timeout=180)
    assert (host.data / "MNIST" / ".torchyard-dataset.json").stat().st_mtime_ns == stamp
