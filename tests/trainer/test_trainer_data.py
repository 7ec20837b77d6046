"""Data sets and batches: file formats, the sample order across ranks and resumes, and the
two batch paths giving the same numbers."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler
from trainer_testlib import write_mnist

from torchyard.contracts.spec import DataSpec
from torchyard.trainer.data import (
    Batches,
    DataError,
    SyntheticSource,
    load_dataset,
    rank_order,
    read_cifar_batch,
    read_idx,
    steps_per_epoch,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(("n", "world"), [(10, 1), (10, 2), (11, 2), (10, 3), (9, 3), (101, 4)])
def test_rank_order_is_distributed_samplers_order(n: int, world: int) -> None:
    for epoch in (0, 3):
        for rank in range(world):
            s = DistributedSampler(
                range(n), num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=True
            )
            s.set_epoch(epoch)
            assert rank_order(n, epoch, 7, rank, world).tolist() == list(s)


@pytest.mark.parametrize("world", [2, 4])
def test_global_batches_do_not_depend_on_world_size(world: int) -> None:
    n, batch, seed = 96, 16, 3
    one = rank_order(n, 1, seed, 0, 1)
    orders = [rank_order(n, 1, seed, r, world) for r in range(world)]
    b = batch // world
    assert steps_per_epoch(n, b, world) == steps_per_epoch(n, batch, 1) == 6
    for k in range(6):
        union = torch.cat([o[k * b : (k + 1) * b] for o in orders])
        assert sorted(union.tolist()) == sorted(one[k * batch : (k + 1) * batch].tolist())


def test_idx_reader_plain_and_gzip_and_corrupt(tmp_path: Path) -> None:
    write_mnist(tmp_path / "plain", 20, 5)
    write_mnist(tmp_path / "gz", 20, 5, gz=True)
    a = read_idx(tmp_path / "plain/MNIST/raw/train-images-idx3-ubyte")
    b = read_idx(tmp_path / "gz/MNIST/raw/train-images-idx3-ubyte.gz")
    assert a.shape == (20, 28, 28) and (a == b).all()
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x08\x01" + (30).to_bytes(4, "big") + b"\x01" * 10)
    with pytest.raises(DataError, match="header says 30"):
        read_idx(bad)


def test_mnist_and_fashion_layouts(mnist_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(DataSpec(name="mnist"), mnist_root, 0)
    assert ds.sample_shape == (1, 28, 28) and len(ds.train) == 600 and len(ds.val) == 200
    assert ds.train.images.dtype == torch.uint8
    write_mnist(tmp_path, 30, 10, folder="FashionMNIST")
    assert len(load_dataset(DataSpec(name="fashion_mnist"), tmp_path, 0).train) == 30


def test_missing_files_are_listed(tmp_path: Path) -> None:
    with pytest.raises(DataError) as e:
        load_dataset(DataSpec(name="cifar10"), tmp_path, 0)
    msg = str(e.value)
    for f in ("data_batch_1", "data_batch_5", "test_batch"):
        assert str(tmp_path / "cifar-10-batches-py" / f) in msg
    assert "TORCHYARD_DATA_ROOT" in msg


def test_cifar_reader_refuses_pickled_code(cifar_root: Path, tmp_path: Path) -> None:
    x, y = read_cifar_batch(cifar_root / "cifar-10-batches-py/data_batch_1")
    assert x.shape == (200, 3, 32, 32) and len(y) == 200

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataError, match="refused global"):
        read_cifar_batch(evil)


def test_digits_split_is_fixed_and_disjoint() -> None:
    a = load_dataset(DataSpec(name="digits", val_fraction=0.25), Path("."), seed=1)
    b = load_dataset(DataSpec(name="digits", val_fraction=0.25), Path("."), seed=2)
    assert len(a.train) + len(a.val) == 1797 and len(a.val) == round(1797 * 0.25)
    assert torch.equal(a.val.images, b.val.images)  # the same held-out set whatever the seed
    assert a.train.images.max() == 16 and a.sample_shape == (1, 8, 8)
    assert load_dataset(DataSpec(name="digits", val_fraction=0.0), Path("."), 0).val is None


def test_synthetic_is_deterministic_and_per_sample() -> None:
    s = SyntheticSource([3, 5, 5], classes=4, seed=9, start=0, count=50)
    x, y = s.tensors()
    x2, y2 = SyntheticSource([3, 5, 5], 4, 9, 0, 50).tensors()
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.dtype == torch.uint8
    xi, yi = s[[7, 3]]
    assert torch.equal(xi[0], x[7]) and int(yi[1]) == int(y[3])
    assert set(y.tolist()) == {0, 1, 2, 3}
    other = SyntheticSource([3, 5, 5], 4, 10, 0, 50).tensors()[0]
    assert not torch.equal(x, other)
    # prototypes made on demand (large shapes) give the same samples
    big = SyntheticSource([3, 5, 5], 4, 9, 0, 50)
    big._prototypes = None
    assert torch.equal(big[[7]][0][0], x[7])


def _batches(ds, loader: str, workers: int = 0, world: int = 1, rank: int = 0) -> Batches:
    return Batches(ds, device=CPU, per_rank_batch=32 // world, rank=rank, world=world, seed=5,
                   loader=loader, num_workers=workers, eval_batch=64)  # fmt: skip


@pytest.mark.parametrize(("workers", "world", "rank"), [(0, 1, 0), (1, 1, 0), (0, 2, 1)])
def test_device_and_dataloader_paths_give_the_same_batches(
    workers: int, world: int, rank: int
) -> None:
    ds = load_dataset(
        DataSpec(name="synthetic", shape=[1, 6, 6], size=300, num_classes=3), Path("."), 0
    )
    fast = _batches(ds, "device", world=world, rank=rank)
    slow = _batches(ds, "dataloader", workers, world=world, rank=rank)
    assert fast.mode == "device" and fast.prenormalised and slow.mode == "dataloader"
    for start in (0, 3):
        a, b = list(fast.train_epoch(2, start)), list(slow.train_epoch(2, start))
        assert len(a) == len(b) == fast.steps_per_epoch - start
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert xa.dtype == xb.dtype == torch.float32
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    va, vb = list(fast.val_batches()), list(slow.val_batches())
    assert sum(len(y) for _, y in va) == 60 // world and fast.n_val == 60
    assert all(torch.equal(p[0], q[0]) for p, q in zip(va, vb, strict=True))


def test_resuming_mid_epoch_continues_the_same_order() -> None:
    ds = load_dataset(DataSpec(name="digits"), Path("."), 0)
    b = _batches(ds, "device")
    full = [y for _, y in b.train_epoch(4)]
    tail = [y for _, y in b.train_epoch(4, start=5)]
    assert all(torch.equal(p, q) for p, q in zip(full[5:], tail, strict=True))
    # normalised to mean ~0, std ~1 on the training set
    x = torch.cat([x for x, _ in b.train_epoch(0)])
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05


def test_validation_shards_cover_the_set_once() -> None:
    ds = load_dataset(DataSpec(name="digits"), Path("."), 0)
    shards = [
        Batches(ds, device=CPU, per_rank_batch=8, rank=r, world=3, loader="device", eval_batch=64)
        for r in range(3)
    ]
    labels = [y for s in shards for _, y in s.val_batches()]
    assert sum(len(y) for y in labels) == len(ds.val)
    assert sorted(torch.cat(labels).tolist()) == sorted(ds.val.labels.tolist())


def test_digits_read_directly_equal_scikit_learns_loader() -> None:
    from sklearn.datasets import load_digits

    from torchyard.trainer.data import read_digits

    x, y = read_digits()
    d = load_digits()
    assert (x == d.images).all() and (y == d.target).all() and x.dtype.name == "uint8"


def test_batches_refuse_an_unknown_loader_and_positional_options() -> None:
    ds = load_dataset(DataSpec(name="digits"), Path("."), 0)
    with pytest.raises(ValueError, match="loader 'gpu': must be one of auto, device, dataloader"):
        Batches(ds, device=CPU, per_rank_batch=8, loader="gpu")
    with pytest.raises(ValueError, match="rank 3 of 3"):
        Batches(ds, device=CPU, per_rank_batch=8, rank=3, world=3)
    with pytest.raises(TypeError):
        Batches(ds, CPU, 8)  # type: ignore[misc]
