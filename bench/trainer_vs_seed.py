"""Samples/s of the trainer against the loops it replaces, on this machine's CPU (or GPU).

    python bench/trainer_vs_seed.py                       # MNIST-format MLP, then CIFAR-format LeNet
    python bench/trainer_vs_seed.py --epochs 2 --skip-cifar
    python bench/trainer_vs_seed.py --mnist-size 20000 --cifar-size 10000   # a quicker run

Writes synthetic data in torchvision's on-disk formats into a temporary directory
(60,000 + 10,000 28x28 images as MNIST idx files; 50,000 + 10,000 32x32x3 images as
CIFAR-10 python batches), then times, for each model:

  (a) seed    the source article's loop: torchvision's MNIST/CIFAR10 data set with
              ToTensor + Normalize, a DataLoader (batch 128, shuffle), SGD 0.01 momentum 0.9,
              the running loss read with .item() every step;
  (b) tensors a hand-written loop over the data preloaded as normalised tensors, shuffled
              by index, the same model and optimizer: the floor the trainer should reach;
  (c) trainer the trainer's own loop (trainer.loop.run, which `python -m torchyard.trainer` runs) on
              the same spec (fp32), in this process, with its events file and an
              end-of-epoch checkpoint on; timed from its `started` event to its last
              end-of-epoch checkpoint event (the steps, metric events and checkpoint writes;
              not data loading nor the final evaluation);

and prints samples/s and the ratios (c)/(b) and (c)/(a), by wall time and by CPU time
(samples per CPU-second: the fair figure on a machine busy with other work; use
--threads 1 there, as spinning OpenMP threads burn CPU while they wait).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
BATCH = 128
LR, MOMENTUM = 0.01, 0.9


# ---------------------------------------------------------------- data in torchvision formats


def _idx(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _images(
    rng: np.random.Generator, n: int, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Learnable synthetic images: a class prototype (the same in every split) plus noise."""
    protos = np.random.default_rng(42).integers(0, 256, (10, *shape)).astype(np.int16)
    y = rng.integers(0, 10, n)
    x = np.empty((n, *shape), dtype=np.uint8)
    for i in range(0, n, 10_000):
        noise = rng.normal(0, 60, (min(10_000, n - i), *shape))
        x[i : i + 10_000] = np.clip(protos[y[i : i + 10_000]] + noise, 0, 255).astype(np.uint8)
    return x, y


def write_mnist(root: Path, n_train: int, n_test: int) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x, y = _images(rng, n, (28, 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(x))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(y))


def write_cifar(root: Path, n_train: int, n_test: int) -> None:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    x, y = _images(rng, n_train + n_test, (3, 32, 32))
    parts = np.array_split(np.arange(n_train), 5)
    for i, idx in enumerate(parts, 1):
        # str keys: what Python 3 reads from the real (Python 2) files with torchvision's latin1
        batch = {"data": x[idx].reshape(len(idx), -1), "labels": y[idx].tolist()}
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    test = {"data": x[n_train:].reshape(n_test, -1), "labels": y[n_train:].tolist()}
    (d / "test_batch").write_bytes(pickle.dumps(test))
    (d / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))


# ---------------------------------------------------------------- the models (as the trainer builds them)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def lenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


# ---------------------------------------------------------------- (a), (b), (c)


class Clock:
    """Wall and CPU time of a span; CPU time stays meaningful on a machine shared with other
    work (with --threads 1), wall time is what a user sees."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def since(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def seed_loop(
    dataset: torch.utils.data.Dataset,
    make_model: Callable[[], nn.Module],
    epochs: int,
    workers: int,
) -> dict:
    """(a) The article's loop, as written there."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=workers
    )
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    n = 0
    clock = Clock()
    for _ in range(epochs):
        running_loss = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            n += len(y)
    return _rates(n, *clock.since())


def tensor_loop(
    x_u8: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    make_model: Callable[[], nn.Module],
    epochs: int,
) -> dict:
    """(b) Preloaded, normalised once, shuffled by index; no per-step host sync."""
    torch.manual_seed(0)
    x = (x_u8.float() - mean) / std
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    n = 0
    total = torch.zeros(())
    clock = Clock()
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(y), BATCH):
            idx = perm[i : i + BATCH]
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            n += len(idx)
    total.item()
    return _rates(n, *clock.since())


def _rates(n: int, wall: float, cpu: float) -> dict:
    return {"samples_per_s": n / wall, "samples_per_cpu_s": n / cpu, "wall_s": wall}


def trainer_run(data_root: Path, run_dir: Path, model: dict, data: str, epochs: int) -> dict:
    """(c) The trainer's own loop (trainer.loop.run, what `python -m torchyard.trainer` calls), in this
    process so that CPU time can be read, writing its real events file and checkpoints.
    Timed from its `started` event to its last end-of-epoch checkpoint event."""
    from torchyard.contracts.spec import parse_spec
    from torchyard.trainer.distributed import Dist
    from torchyard.trainer.events import JsonlEvents
    from torchyard.trainer.loop import Run, run

    spec = parse_spec(
        {
            "model": model,
            "data": {"name": data},
            "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
            "batch_size": BATCH,
            "epochs": epochs,
            "precision": "fp32",
            "checkpoint": {"every_epochs": 1},
            "eval_every_epochs": 0,  # evaluate once, at the end (after the timed span)
        }
    )
    run_dir.mkdir(parents=True)

    class Timed(JsonlEvents):
        marks: list[tuple[str, dict, float, float]] = []

        def emit(self, type: str, **fields: object) -> None:
            super().emit(type, **fields)
            self.marks.append((type, fields, time.perf_counter(), time.process_time()))

    events = Timed(run_dir / "events.jsonl")
    dist = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    code = run(
        spec,
        Run(run_dir=run_dir, dist=dist, events=events, data_root=data_root, log=lambda _s: None),
    )
    events.close()
    if code != 0:
        raise SystemExit(f"trainer failed with exit code {code}")
    started = next(m for m in events.marks if m[0] == "started")
    ckpt = [m for m in events.marks if m[0] == "checkpoint" and m[1]["kind"] == "resume"][-1]
    finished = next(m for m in events.marks if m[0] == "finished")
    out = _rates(started[1]["train_samples"] * epochs, ckpt[2] - started[2], ckpt[3] - started[3])
    out.update(
        loader=started[1]["loader"],
        val_accuracy=finished[1]["metrics"].get("val/accuracy"),
        checkpoint_bytes=ckpt[1]["bytes"],
    )
    return out


def best_of(
    n: int, a: Callable[[], dict], b: Callable[[], dict], c: Callable[[int], dict]
) -> tuple[dict, dict, dict]:
    """Run the three variants n times, interleaved (so a busy spell hurts all alike); keep
    each one's best (by wall time)."""
    runs = [(a(), b(), c(i)) for i in range(n)]
    return tuple(max((r[k] for r in runs), key=lambda d: d["samples_per_s"]) for k in range(3))


def bench(name: str, a: dict, b: dict, c: dict) -> dict:
    print(f"\n{name}                                 samples/s (wall)   samples per CPU-second")
    for label, r in (
        ("(a) seed loop (torchvision + DataLoader)", a),
        ("(b) hand-written preloaded tensors      ", b),
        ("(c) trainer (events + checkpoint)       ", c),
    ):
        print(f"  {label} {r['samples_per_s']:>14,.0f} {r['samples_per_cpu_s']:>16,.0f}")
    print(
        f"  (c): {c['loader']} path, {c['wall_s']:.2f}s, val/accuracy {c['val_accuracy']:.3f}, "
        f"checkpoint {c['checkpoint_bytes']:,} bytes"
    )
    ratios = {
        "c_over_b": c["samples_per_s"] / b["samples_per_s"],
        "c_over_a": c["samples_per_s"] / a["samples_per_s"],
        "c_over_b_cpu": c["samples_per_cpu_s"] / b["samples_per_cpu_s"],
        "c_over_a_cpu": c["samples_per_cpu_s"] / a["samples_per_cpu_s"],
    }
    print(f"  wall: (c)/(b) = {ratios['c_over_b']:.2f}   (c)/(a) = {ratios['c_over_a']:.1f}")
    print(
        f"  CPU:  (c)/(b) = {ratios['c_over_b_cpu']:.2f}   (c)/(a) = {ratios['c_over_a_cpu']:.1f}"
    )
    return {"a": a, "b": b, "c": c, **ratios}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mnist-size", type=int, default=60_000, help="MNIST-format training images")
    ap.add_argument("--cifar-size", type=int, default=50_000, help="CIFAR-format training images")
    ap.add_argument("--test-size", type=int, default=10_000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument(
        "--workers", type=int, default=0, help="DataLoader workers of the seed loop (a)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant; the best counts")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--skip-cifar", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    return ap.parse_args(argv)


def bench_mnist(root: Path, args: argparse.Namespace) -> dict:
    """MNIST-format files, the MLP: (a), (b) and (c) once each."""
    import torchvision
    from torchvision import transforms

    write_mnist(root, args.mnist_size, args.test_size)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    ds = torchvision.datasets.MNIST(str(root), train=True, download=False, transform=tf)
    a = seed_loop(ds, mlp, args.epochs, args.workers)
    mean, std = torch.tensor(0.1307 * 255), torch.tensor(0.3081 * 255)
    b = tensor_loop(ds.data.unsqueeze(1), ds.targets, mean, std, mlp, args.epochs)
    c = trainer_run(
        root, root / "run-mnist", {"name": "mlp", "hidden": [128]}, "mnist", args.epochs
    )
    return bench("MNIST-format, MLP 784-128-10", a, b, c)


def bench_cifar(root: Path, args: argparse.Namespace) -> dict:
    """CIFAR-format files, LeNet: the best of `--repeat` interleaved runs of each."""
    import torchvision
    from torchvision import transforms

    write_cifar(root, args.cifar_size, args.test_size)

    class SyntheticCIFAR10(torchvision.datasets.CIFAR10):
        # Our files are not the real ones: skip torchvision's md5 checks.
        def _check_integrity(self) -> bool:
            return True

        def _load_meta(self) -> None:
            self.classes = [str(i) for i in range(10)]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    tf = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]
    )
    ds = SyntheticCIFAR10(str(root), train=True, download=False, transform=tf)
    x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    y = torch.tensor(ds.targets)
    half = torch.tensor(127.5)
    a, b, c = best_of(
        args.repeat,
        lambda: seed_loop(ds, lenet, args.epochs, args.workers),
        lambda: tensor_loop(x, y, half, half, lenet, args.epochs),
        lambda i: trainer_run(
            root, root / f"run-cifar-{i}", {"name": "lenet"}, "cifar10", args.epochs
        ),
    )
    return bench("CIFAR-format, LeNet", a, b, c)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torchvision

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; epochs {args.epochs}"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="ty-bench-") as tmp:
        root = Path(tmp)
        results["mnist_mlp"] = bench_mnist(root, args)
        if not args.skip_cifar:
            results["cifar_lenet"] = bench_cifar(root, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
