"""Data sets as uint8 tensors (or, for ImageFolder sets and the user's own, map-style
datasets read through a DataLoader), and the two ways batches reach the model.

Every set is read once into host memory as uint8 images `(N, C, H, W)` (or `(N, D)`) plus
int64 labels; `synthetic` can also produce any sample on demand, so sets larger than
memory work through a DataLoader. Normalisation is one function of the raw uint8 values,
`(x - mean) / std`, applied on the device to whole batches (or once to the whole set), so
both paths give the same numbers.

Sample order: each epoch is a permutation of the training set drawn from `seed + epoch`
(the same as DistributedSampler with drop_last=True); rank r takes every W-th index of it,
and its k-th batch is the k-th chunk of that. The union over ranks of their k-th batches is
the same global batch whatever W is, and a resumed run skips to batch k of the epoch
without replaying anything.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import itertools
import math
import os
import pickle
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from torchyard.contracts.datasets import (
    CIFAR10_BATCHES,
    DATASET_FILES,
    dataset_file,
    missing_dataset_files,
    split_sizes,
)
from torchyard.contracts.spec import DataSpec
from torchyard.trainer.failures import UserCodeError
from torchyard.trainer.usercode import call_user, load_factory

# The validation split of sets without a test split is fixed (not drawn from the job's seed),
# so jobs with different seeds are compared on the same held-out samples.
SPLIT_SEED = 0
# Normalisation constants in raw uint8 units (torchvision's customary values x 255).
_STATS: dict[str, tuple[list[float], list[float]]] = {
    "mnist": ([0.1307 * 255], [0.3081 * 255]),
    "fashion_mnist": ([0.2860 * 255], [0.3530 * 255]),
    "cifar10": (
        [0.4914 * 255, 0.4822 * 255, 0.4465 * 255],
        [0.2470 * 255, 0.2435 * 255, 0.2616 * 255],
    ),
    "synthetic": ([127.5], [80.0]),
}
# Samples per evaluation batch (at least the training batch): no gradients, so larger.
EVAL_BATCH = 1024
LOADERS = ("auto", "device", "dataloader")  # DataSpec.loader's values
# Synthetic samples: class prototype + Gaussian noise of this std (uint8 units), clipped.
SYNTHETIC_NOISE = 60.0
# ImageFolder sets are normalised with ImageNet's statistics (torchvision's convention).
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# The data sets' own label names (torchvision's), index = label.
FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip


class DataError(Exception):
    """The data set cannot be read (missing or malformed files)."""


def data_root_from_env() -> Path:
    """TORCHYARD_DATA_ROOT, else `$TORCHYARD_HOME/data` (default `./.torchyard/data`), as the
    server's settings define it."""
    root = os.environ.get("TORCHYARD_DATA_ROOT")
    if root:
        return Path(root)
    return Path(os.environ.get("TORCHYARD_HOME", ".torchyard")) / "data"


# ---------------------------------------------------------------------------- sources


class TensorSource(torch.utils.data.Dataset):
    """Images (uint8) and labels (int64) in memory. Indexed by a list of indices, it returns a
    whole batch: DataLoader workers then do one gather per batch, not one per sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        assert images.dtype == torch.uint8 and len(images) == len(labels)
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(idx, dtype=torch.long)
        return self.images.index_select(0, i), self.labels.index_select(0, i)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images, self.labels

    @property
    def nbytes(self) -> int:
        return self.images.numel()


class SyntheticSource(torch.utils.data.Dataset):
    """Deterministic, learnable samples: sample i is its class prototype plus noise drawn from a
    generator seeded by (seed, i), so any sample can be made on its own, in any process."""

    def __init__(self, shape: list[int], classes: int, seed: int, start: int, count: int):
        self.shape, self.classes, self.seed = list(shape), classes, seed
        self.start, self.count = start, count
        # All prototypes at once when small; one at a time (made on demand) when not.
        self._prototypes = (
            torch.stack([self.prototype(c) for c in range(classes)])
            if classes * math.prod(shape) <= 1 << 24
            else None
        )

    def prototype(self, c: int) -> torch.Tensor:
        if getattr(self, "_prototypes", None) is not None:
            return self._prototypes[c]  # type: ignore[index]
        g = torch.Generator().manual_seed((self.seed * 7919 + c) % 2**63)
        return torch.rand(self.shape, generator=g) * 255.0

    def __len__(self) -> int:
        return self.count

    def sample(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.start + i) % 2**63)
        y = int(torch.randint(self.classes, (1,), generator=g))
        noise = torch.randn(self.shape, generator=g) * SYNTHETIC_NOISE
        x = (self.prototype(y) + noise).round_().clamp_(0, 255).to(torch.uint8)
        return x, y

    def __getitem__(self, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs = torch.empty((len(idx), *self.shape), dtype=torch.uint8)
        ys = torch.empty(len(idx), dtype=torch.long)
        for j, i in enumerate(idx):
            xs[j], ys[j] = self.sample(int(i))
        return xs, ys

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self[range(self.count)]

    @property
    def nbytes(self) -> int:
        return self.count * math.prod(self.shape)


class ItemSource(torch.utils.data.Dataset):
    """A map-style dataset of `(input_tensor, int_label)` items (ImageFolder's, or the user's),
    given a batch at a time like the other sources, so DataLoader workers gather whole
    batches. A failure reading an item is the data set's: `error` is DataError for
    ImageFolder and UserCodeError for the user's own (raised in the main process too,
    since the DataLoader re-raises a worker's exception with its type and message)."""

    def __init__(self, items: torch.utils.data.Dataset, classes: int, what: str, error: type):
        self.items, self.classes, self.what, self.error = items, classes, what, error

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]

    def item(self, i: int) -> tuple[torch.Tensor, int]:
        try:
            x, y = self.items[i]
        except Exception as e:
            raise self.error(f"{self.what}: reading item {i}: {type(e).__name__}: {e}") from e
        if not isinstance(x, torch.Tensor) or isinstance(y, bool):
            raise self.error(f"{self.what}: item {i} is not (input tensor, int label)")
        label = int(y)  # an int, or a 0-d integer tensor
        if not 0 <= label < self.classes:
            raise self.error(
                f"{self.what}: item {i} has label {label}, not in 0..{self.classes - 1}"
            )
        return x, label

    def __getitem__(self, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.item(int(i)) for i in idx]
        return torch.stack([x for x, _ in pairs]), torch.tensor([y for _, y in pairs])

    @property
    def nbytes(self) -> int:
        return 0  # read from disk batch by batch: never resident


Source = TensorSource | SyntheticSource | ItemSource


@dataclass
class DataSet:
    name: str
    train: Source
    val: Source | None
    sample_shape: tuple[int, ...]
    num_classes: int
    mean: list[float]
    std: list[float]
    streamed: bool = False  # item by item through a DataLoader: never on the device whole
    classes: list[str] | None = None  # class names, index = label (None: the labels)

    def class_names(self) -> list[str]:
        return list(self.classes) if self.classes else [str(i) for i in range(self.num_classes)]

    def input_normalization(self) -> tuple[list[float], list[float]]:
        """(mean, std) that turn an input as the data set's files hold it (uint8 pixels,
        digits' 0..16) into what the model was trained on. ImageFolder's transform
        normalises inside the loader, so for it this is ImageNet's statistics in uint8
        units (inputs: resized and center-cropped uint8 [C, H, W])."""
        if self.name.startswith("imagefolder/"):
            return [m * 255 for m in IMAGENET_MEAN], [s * 255 for s in IMAGENET_STD]
        return list(self.mean), list(self.std)


# ---------------------------------------------------------------------------- readers


def _open(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def read_idx(path: Path) -> np.ndarray:
    """An idx-ubyte file (MNIST's format), plain or gzipped, as a uint8 array."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path}: not an idx file of unsigned bytes")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * k : 8 + 4 * k], "big") for k in range(ndim)]
    body = 4 + 4 * ndim
    if len(raw) - body != math.prod(dims):
        raise DataError(f"{path}: holds {len(raw) - body} bytes, its header says {math.prod(dims)}")
    return np.frombuffer(raw, dtype=np.uint8, offset=body).reshape(dims)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles of numpy arrays: allow the numpy array
    reconstructors and nothing else, so a planted file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as f:
        try:
            d = _NumpyOnlyUnpickler(f, encoding="bytes").load()
        except Exception as e:
            raise DataError(f"{path}: not a CIFAR python batch ({e})") from None
    # Keys are bytes in the original (Python 2) files read this way, str in files written by
    # Python 3: accept both.
    d = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in d.items()}
    try:
        x = np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(d["labels"], dtype=np.int64)
    except (KeyError, ValueError, TypeError) as e:
        raise DataError(f"{path}: not a CIFAR python batch ({e})") from None
    if len(x) != len(y):
        raise DataError(f"{path}: {len(x)} images but {len(y)} labels")
    return x, y


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (values 0..16) as uint8 (N, 8, 8) and labels. Read
    from its csv directly when it is where scikit-learn keeps it: importing sklearn.datasets
    costs more than the whole training run."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            table = np.loadtxt(csv, delimiter=",", dtype=np.float64)
            return table[:, :-1].astype(np.uint8).reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


def _require_files(name: str, root: Path) -> list[Path]:
    missing = missing_dataset_files(name, root)
    if missing:
        listed = ", ".join(str(p) for p in missing)
        raise DataError(
            f"data set '{name}' is not on disk: looked for {listed} "
            f"(data root {root}, set by TORCHYARD_DATA_ROOT; nothing is downloaded)"
        )
    found = [dataset_file(name, root, rel) for rel in DATASET_FILES[name]]
    return [p for p in found if p is not None]


def _to_source(x: np.ndarray, y: np.ndarray, classes: int, what: str) -> TensorSource:
    labels = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f"{what}: labels outside 0..{classes - 1}")
    # A copy: idx arrays are read-only views of the file bytes.
    return TensorSource(torch.from_numpy(np.array(x, dtype=np.uint8, order="C")), labels)


def _split(src: TensorSource, val_fraction: float) -> tuple[TensorSource, TensorSource | None]:
    n_val = split_sizes(len(src), val_fraction)[1]
    if n_val == 0:
        return src, None
    perm = torch.randperm(len(src), generator=torch.Generator().manual_seed(SPLIT_SEED))
    val_i, train_i = perm[:n_val].sort().values, perm[n_val:].sort().values
    x, y = src.tensors()
    return TensorSource(x[train_i], y[train_i]), TensorSource(x[val_i], y[val_i])


def load_imagefolder(spec: DataSpec, data_root: Path) -> DataSet:
    """`imagefolder/<dir>`: `<root>/<dir>/{train,val}/<class>/*` images, with the usual train
    augmentation (random resized crop, flip) and eval transform (resize, center crop)."""
    from torchvision import datasets
    from torchvision import transforms as T

    if missing := missing_dataset_files(spec.name, data_root):
        raise DataError(
            f"data set '{spec.name}' is not on disk: looked for "
            + ", ".join(f"{p}/" for p in missing)
            + f" (data root {data_root})"
        )
    size, norm = spec.crop, T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(), norm])
    top = data_root / spec.folder
    try:
        train = datasets.ImageFolder(str(top / "train"), transform=train_tf)
        val = datasets.ImageFolder(str(top / "val"), transform=eval_tf)
    except (FileNotFoundError, OSError) as e:
        raise DataError(f"data set '{spec.name}': {e}") from None
    if train.classes != val.classes:
        raise DataError(
            f"data set '{spec.name}': train has classes {train.classes}, val {val.classes}"
        )
    k = len(train.classes)
    return DataSet(
        spec.name,
        ItemSource(train, k, spec.name, DataError),
        ItemSource(val, k, spec.name, DataError),
        (3, size, size),
        k,
        [0.0],
        [1.0],  # the transform normalises
        streamed=True,
        classes=list(train.classes),
    )


def load_factory_data(spec: DataSpec, data_root: Path) -> DataSet:
    """`module:function`: the user's `function(root=, **args) -> (train, val, num_classes)`."""
    name = spec.name
    fn = load_factory(name)
    out = call_user(f"building the data set {name}", fn, root=data_root, **(spec.args or {}))
    if not isinstance(out, tuple | list) or len(out) != 3:
        raise UserCodeError(
            f"data set {name} returned {type(out).__name__}, not "
            "(train_dataset, val_dataset, num_classes)"
        )
    train, val, k = out
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserCodeError(f"data set {name}: num_classes must be a positive int, not {k!r}")
    for part, ds in (("train", train), ("val", val)):
        if ds is not None and not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise UserCodeError(f"data set {name}: {part} is not a map-style dataset")
    if len(train) == 0:
        raise UserCodeError(f"data set {name}: the training set is empty")
    src = ItemSource(train, k, name, UserCodeError)
    x, _ = src.item(0)
    val_src = ItemSource(val, k, name, UserCodeError) if val is not None and len(val) else None
    names = getattr(train, "classes", None)
    classes = [str(c) for c in names] if isinstance(names, list) and len(names) == k else None
    return DataSet(
        name, src, val_src, tuple(x.shape), k, [0.0], [1.0], streamed=True, classes=classes
    )


def load_dataset(spec: DataSpec, data_root: Path, seed: int) -> DataSet:
    """Read (or generate) the data set of a spec. Raises DataError naming the files looked for."""
    name = spec.name
    if spec.kind == "imagefolder":
        return load_imagefolder(spec, data_root)
    if spec.kind == "factory":
        return load_factory_data(spec, data_root)
    if name == "digits":
        images, target = read_digits()
        src = _to_source(images[:, None], target, 10, "digits")
        train, val = _split(src, spec.val_fraction)
        # Digits hold 0..16: its own statistics, from the training split only.
        xf = train.images.double()
        return DataSet(name, train, val, (1, 8, 8), 10, [xf.mean().item()], [xf.std().item()])
    if name in ("mnist", "fashion_mnist"):
        files = _require_files(name, data_root)
        xs, ys = [read_idx(p) for p in files[0::2]], [read_idx(p) for p in files[1::2]]
        for x, y, p in zip(xs, ys, files[0::2], strict=True):
            if x.ndim != 3 or len(x) != len(y):
                raise DataError(f"{p}: expected NxHxW images matching its labels file")
        train = _to_source(xs[0][:, None], ys[0], 10, name)
        val = _to_source(xs[1][:, None], ys[1], 10, name)
        mean, std = _STATS[name]
        names = FASHION_CLASSES if name == "fashion_mnist" else None
        return DataSet(
            name, train, val, tuple(train.images.shape[1:]), 10, mean, std, classes=names
        )
    if name == "cifar10":
        files = _require_files(name, data_root)
        # The batches in CIFAR10_BATCHES' order (train 1..5, then test); not batches.meta.
        parts = [read_cifar_batch(p) for p in files if p.name in CIFAR10_BATCHES]
        x = np.concatenate([p[0] for p in parts[:-1]])
        y = np.concatenate([p[1] for p in parts[:-1]])
        train = _to_source(x, y, 10, name)
        val = _to_source(parts[-1][0], parts[-1][1], 10, name)
        mean, std = _STATS[name]
        return DataSet(name, train, val, (3, 32, 32), 10, mean, std, classes=CIFAR10_CLASSES)
    if name == "synthetic":
        n_train, n_val = split_sizes(spec.samples, spec.val_fraction)
        shape, k = spec.sample_shape, spec.classes
        train_s = SyntheticSource(shape, k, seed, 0, n_train)
        val_s = SyntheticSource(shape, k, seed, n_train, n_val) if n_val else None
        mean, std = _STATS[name]
        return DataSet(name, train_s, val_s, tuple(shape), k, mean, std)
    raise DataError(f"unknown data set {name!r}")


# ---------------------------------------------------------------------------- batches


class Normalizer:
    """(x - mean) / std per channel, on the device, from raw uint8 values."""

    def __init__(self, ds: DataSet, device: torch.device):
        c = len(ds.mean)
        extra = len(ds.sample_shape) - 1
        view = (c, *([1] * extra)) if c > 1 else ()
        self.mean = torch.tensor(ds.mean, dtype=torch.float32, device=device).view(view)
        self.std = torch.tensor(ds.std, dtype=torch.float32, device=device).view(view)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().sub_(self.mean).div_(self.std)


def rank_order(n: int, epoch: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sample indices for an epoch: DistributedSampler's order (shuffle, drop_last)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[: (n // world) * world][rank::world]


def steps_per_epoch(n: int, per_rank_batch: int, world: int) -> int:
    return math.ceil((n // world) / per_rank_batch)


def _ignore_stop_signals(_worker_id: int) -> None:
    # A SIGTERM sent to the whole process group must reach the main process only: it saves a
    # checkpoint and shuts its loader down; workers killed under it would break that save.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class EpochSampler(DistributedSampler):
    """DistributedSampler (set_epoch, shuffle, drop_last) that can start mid-epoch."""

    def __init__(self, n: int, world: int, rank: int, seed: int):
        # A sampler reads only len() of its data set: a range stands in for it.
        super().__init__(
            range(n),  # type: ignore[arg-type]
            num_replicas=world,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class Batches:
    """Train and validation batches for one rank, already on the device and normalised.

    `device` path: the set lives on the device (normalised once when it fits, else as uint8
    normalised per batch) and a batch is one index_select (on a GPU, a slice of a copy
    shuffled once per epoch). `dataloader` path: a DataLoader
    with workers gathers uint8 batches in pinned memory, copied with non_blocking and
    normalised on the device.

    Everything but the data set is keyword-only: `per_rank_batch` samples a step from rank
    `rank` of `world`, in the order `seed` gives each epoch (see the module docstring)."""

    def __init__(
        self,
        ds: DataSet,
        *,
        device: torch.device,
        per_rank_batch: int,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        loader: str = "auto",
        num_workers: int = 0,
        eval_batch: int = EVAL_BATCH,
        channels_last: bool = False,
    ):
        if loader not in LOADERS:
            raise ValueError(f"loader {loader!r}: must be one of {', '.join(LOADERS)}")
        if per_rank_batch < 1 or not 0 <= rank < world:
            raise ValueError(f"per_rank_batch {per_rank_batch}, rank {rank} of {world}: no batches")
        self.ds, self.device, self.b = ds, device, per_rank_batch
        self.rank, self.world, self.seed = rank, world, seed
        self.norm = Normalizer(ds, device)
        self.eval_batch = max(eval_batch, per_rank_batch)
        self.channels_last = channels_last and len(ds.sample_shape) == 3
        self.n_train = len(ds.train)
        self.n_val = len(ds.val) if ds.val is not None else 0
        self.steps_per_epoch = steps_per_epoch(self.n_train, per_rank_batch, world)
        total = ds.train.nbytes + (ds.val.nbytes if ds.val is not None else 0)
        budget = memory_budget(device)
        if ds.streamed:
            self.mode = "dataloader"
        else:
            self.mode = (
                loader if loader != "auto" else ("device" if total <= budget else "dataloader")
            )
        self.prenormalised = self.mode == "device" and 4 * total <= budget
        # On a GPU, one gather per epoch into a shuffled copy makes every batch a contiguous
        # slice: two kernel launches fewer per step (when the copy fits too). On a CPU a batch
        # gathered just before use is still in cache, and that is faster.
        resident = (4 if self.prenormalised else 1) * total
        epoch_copy = (4 if self.prenormalised else 1) * ds.train.nbytes // world
        self.gather_per_epoch = (
            self.mode == "device" and device.type == "cuda" and resident + epoch_copy <= budget
        )
        if self.mode == "device":
            self._train = self._to_device(ds.train)
            self._val = self._to_device(ds.val) if ds.val is not None else None
        else:
            self._make_loaders(num_workers)

    def _make_loaders(self, workers: int) -> None:
        """The `dataloader` path: this rank's sampler, its training and validation loaders."""
        pin = self.device.type == "cuda"
        self.sampler = EpochSampler(self.n_train, self.world, self.rank, self.seed)
        batch_sampler = BatchSampler(self.sampler, self.b, drop_last=False)
        self.loader = self._loader(self.ds.train, batch_sampler, workers, pin)
        if self.ds.val is not None:
            shard = list(range(self.rank, self.n_val, self.world))
            step = self.eval_batch
            chunks = [shard[i : i + step] for i in range(0, len(shard), step)]
            self.val_loader = self._loader(self.ds.val, chunks, workers, pin)

    def _loader(self, src: Source, batch_sampler: object, workers: int, pin: bool) -> DataLoader:
        # batch_size=None: the source itself returns a batch for a list of indices.
        return DataLoader(
            src,
            batch_size=None,
            sampler=batch_sampler,  # type: ignore[arg-type]
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            worker_init_fn=_ignore_stop_signals if workers > 0 else None,
        )

    def _to_device(self, src: Source) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(src, ItemSource):  # a streamed set always takes the DataLoader path
            raise TypeError(f"{src.what} is read item by item: it cannot live on the device")
        x, y = src.tensors()
        x, y = x.to(self.device), y.to(self.device)
        if self.prenormalised:
            # In chunks, so the float copy is the only large temporary.
            out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
            for i in range(0, len(x), 8192):
                out[i : i + 8192] = self.norm(x[i : i + 8192])
            x = out
        # Kept NCHW even for channels_last: index_select returns NCHW whatever its input's
        # layout, so a channels_last resident set would be converted twice per batch.
        # `_prepare` converts each batch once instead.
        return x, y

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = self.norm(x)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def train_epoch(
        self, epoch: int, start: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of an epoch, from batch `start` on."""
        b = self.b
        if self.mode == "device":
            xs, ys = self._train
            order = rank_order(self.n_train, epoch, self.seed, self.rank, self.world).to(
                self.device
            )
            if self.gather_per_epoch:
                rest = order[start * b :]
                xe, ye = xs.index_select(0, rest), ys.index_select(0, rest)
                for i in range(0, len(rest), b):
                    yield self._prepare(xe[i : i + b]), ye[i : i + b]
                return
            for k in range(start, self.steps_per_epoch):
                idx = order[k * b : (k + 1) * b]
                yield self._prepare(xs.index_select(0, idx)), ys.index_select(0, idx)
        else:
            self.sampler.set_epoch(epoch)
            self.sampler.skip = start * b
            for x, y in self.loader:
                x = x.to(self.device, non_blocking=True)
                yield self._prepare(x), y.to(self.device, non_blocking=True)

    def val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's shard of the validation set (every W-th sample), in order."""
        if self.ds.val is None:
            return
        if self.mode == "device":
            assert self._val is not None
            xs, ys = self._val
            shard = torch.arange(self.rank, self.n_val, self.world, device=self.device)
            for i in range(0, len(shard), self.eval_batch):
                idx = shard[i : i + self.eval_batch]
                yield self._prepare(xs.index_select(0, idx)), ys.index_select(0, idx)
        else:
            for x, y in self.val_loader:
                x = x.to(self.device, non_blocking=True)
                yield self._prepare(x), y.to(self.device, non_blocking=True)


def memory_budget(device: torch.device) -> int:
    """Bytes the data set may take on the device: a quarter of what is free."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 4
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 4 << 30
    return avail // 4
