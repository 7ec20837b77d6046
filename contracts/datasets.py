"""The data-set catalogue and the size estimates the server's limits use, without torch:
which files each on-disk data set needs (`missing_dataset_files`, so a submit is refused
with 422 before anything is queued), how many samples and classes the built-in sets hold,
a model's parameter count and a data set's bytes (`limit_problems`), and what runs but is
likely not meant (`size_warnings`: a batch larger than the training set)."""

from __future__ import annotations

import gzip
import itertools
import math
from pathlib import Path

from torchyard.contracts.spec import (
    IMAGEFOLDER_RE,
    DataSpec,
    JobSpec,
)

# Files of each on-disk data set, relative to the data root, in torchvision's layouts
# (`<root>/MNIST/raw/…`, `<root>/cifar-10-batches-py/…`); idx files may also be gzipped.
_IDX = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_BATCHES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
)
# torchyard reads the batches only (its class names are CIFAR-10's own), but the folder must
# be torchvision's whole layout: torchvision's CIFAR10 (in a user's own data factory, say)
# refuses one without batches.meta, where it reads the class names.
CIFAR10_META = "batches.meta"
DATASET_FILES: dict[str, tuple[str, ...]] = {
    "mnist": tuple(f"MNIST/raw/{f}" for f in _IDX),
    "fashion_mnist": tuple(f"FashionMNIST/raw/{f}" for f in _IDX),
    "cifar10": tuple(f"cifar-10-batches-py/{f}" for f in (*CIFAR10_BATCHES, CIFAR10_META)),
}
# Sets whose idx files may be stored gzipped (`<file>.gz`) instead.
_GZIP_OK = frozenset({"mnist", "fashion_mnist"})


def dataset_file(name: str, data_root: Path, relative: str) -> Path | None:
    """The path of one data file as found on disk (plain, or `.gz` where allowed), or None."""
    plain = data_root / relative
    if plain.is_file():
        return plain
    if name in _GZIP_OK:
        gz = data_root / (relative + ".gz")
        if gz.is_file():
            return gz
    return None


def missing_dataset_files(name: str, data_root: Path) -> list[Path]:
    """The files (or, for `imagefolder/<dir>`, folders) looked for under `data_root` that are
    absent: empty when all are present, or when the data set needs no files (`digits`,
    `synthetic`, a factory). A gzipped idx file counts."""
    if IMAGEFOLDER_RE.fullmatch(name):
        top = data_root / name.partition("/")[2]
        return [d for d in (top / "train", top / "val") if not d.is_dir()]
    return [
        data_root / rel
        for rel in DATASET_FILES.get(name, ())
        if dataset_file(name, data_root, rel) is None
    ]


# ---------------------------------------------------------------------------- size limits

# What each built-in data set gives the trainer (trainer/data.py): sample shape and
# samples in train + validation/test together (the whole set is resident on every rank).
DATASET_SHAPES: dict[str, tuple[int, ...]] = {
    "digits": (1, 8, 8),
    "mnist": (1, 28, 28),
    "fashion_mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
}
DATASET_SAMPLES = {"digits": 1797, "mnist": 70_000, "fashion_mnist": 70_000, "cifar10": 60_000}
# Samples in the training split of the sets that come with a test split (the official files).
DATASET_TRAIN_SAMPLES = {"mnist": 60_000, "fashion_mnist": 60_000, "cifar10": 50_000}
DATASET_CLASSES = {"digits": 10, "mnist": 10, "fashion_mnist": 10, "cifar10": 10}
# Labels are int64 on the device beside the images.
LABEL_BYTES = 8
# ResNet-18 without its first conv and its fc (both depend on the data): every other
# parameter, whatever the image size (torchvision's ResNet pools adaptively).
_RESNET18_BODY = 11_167_104


def data_shape(data: DataSpec) -> tuple[int, ...] | None:
    """The sample shape the data set gives the model (None: known only once it is read)."""
    if data.kind == "imagefolder":
        return (3, data.crop, data.crop)
    if data.kind == "factory":
        return None
    return tuple(data.sample_shape) if data.name == "synthetic" else DATASET_SHAPES[data.name]


def data_classes(data: DataSpec) -> int | None:
    if data.kind != "builtin":
        return None
    return data.classes if data.name == "synthetic" else DATASET_CLASSES[data.name]


# Sets without a test split: validation is held out of the training set (`val_fraction`).
_SPLIT_SETS = frozenset({"digits", "synthetic"})


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(train, validation) samples of a set of n without a test split: the one rule the
    trainer's split and the submit's warnings share."""
    n_val = round(n * val_fraction)
    return n - n_val, n_val


def _idx_count(path: Path) -> int | None:
    """The first dimension in an idx file's header (plain or gzipped): its sample count."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
            head = f.read(8)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return int.from_bytes(head[4:8], "big") if len(head) == 8 and head[3] >= 1 else None


def train_samples(data: DataSpec, data_root: Path | None = None) -> int | None:
    """Samples in the training split of a built-in data set: from the spec alone (`digits`,
    `synthetic`), from the idx header of MNIST-format files in `data_root`, else the official
    count; None for sets known only once read (`imagefolder/<dir>`, a factory)."""
    if data.kind != "builtin":
        return None
    if data.name in _SPLIT_SETS:
        total = data.samples if data.name == "synthetic" else DATASET_SAMPLES["digits"]
        return split_sizes(total, data.val_fraction)[0]
    if data_root is not None and data.name in _GZIP_OK:
        path = dataset_file(data.name, data_root, DATASET_FILES[data.name][0])
        if path is not None and (n := _idx_count(path)) is not None:
            return n
    return DATASET_TRAIN_SAMPLES[data.name]


def size_warnings(spec: JobSpec, data_root: Path | None = None) -> list[tuple[str, str]]:
    """What a valid spec asks that runs but is likely not what was meant, as (field,
    message) pairs: a global batch larger than the training set."""
    if spec.data is None:  # a script job reads its own data
        return []
    n = train_samples(spec.data, data_root)
    if n is None or spec.batch_size <= n:
        return []
    split = f", val_fraction {spec.data.val_fraction}" if spec.data.name in _SPLIT_SETS else ""
    return [
        (
            "batch_size",
            f"{spec.batch_size} is more than the training set's {n} samples "
            f"('{spec.data.name}'{split}): each epoch is one step over the whole set",
        )
    ]


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def model_parameters(spec: JobSpec) -> int | None:
    """Parameters of the spec's built-in model (trainer/models.py) for its data's shape and
    classes, computed without building it; None when that needs the model or data built."""
    assert spec.model is not None and spec.data is not None
    shape, k = data_shape(spec.data), data_classes(spec.data)
    if spec.model.kind != "builtin" or shape is None or k is None:
        return None
    if spec.model.name == "mlp":
        widths = [math.prod(shape), *spec.model.hidden_sizes, k]
        return sum(_linear(a, b) for a, b in itertools.pairwise(widths))
    c, h, w = shape  # conv models need [C, H, W]: the spec's own check guarantees it
    if spec.model.name == "lenet":
        # Two 5x5 convs (padding 2 below 16 pixels a side), each followed by a 2x2 max-pool.
        pad = 0 if min(h, w) >= 16 else 2
        for _ in range(2):
            h, w = (h + 2 * pad - 4) // 2, (w + 2 * pad - 4) // 2
        convs = (c * 25 + 1) * 6 + (6 * 25 + 1) * 16
        return convs + _linear(16 * h * w, 120) + _linear(120, 84) + _linear(84, k)
    # resnet18: 3x3 first conv without bias, fc 512 -> classes.
    return _RESNET18_BODY + c * 64 * 9 + _linear(512, k)


def data_bytes(data: DataSpec) -> int | None:
    """Bytes the data set takes on the device on the trainer's fast path: every sample (train
    and validation) as uint8 values plus an int64 label. The trainer makes a float32 copy (4x
    the images) only when that fits in a quarter of free device memory, so the uint8 size is
    what a job needs. None for sets that stream from disk through a DataLoader."""
    if data.kind != "builtin":
        return None
    shape = data_shape(data)
    assert shape is not None
    samples = data.samples if data.name == "synthetic" else DATASET_SAMPLES[data.name]
    return samples * (math.prod(shape) + LABEL_BYTES)


def _si(n: float, units: tuple[str, ...], base: int) -> str:
    # Three significant digits and a unit: 64.5 G, 2 G, 16 GiB.
    for unit in units[:-1]:
        if abs(n) < 999.5:
            return f"{n:.3g} {unit}".rstrip()
        n /= base
    return f"{n:.3g} {units[-1]}"


def _count(n: float) -> str:
    return _si(n, ("", "K", "M", "G", "T", "P"), 1000)


def _bytes(n: float) -> str:
    return _si(n, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024)


def too_many_parameters(params: int, max_params: int, what: str = "this model") -> str:
    """The words of a model over TORCHYARD_MAX_MODEL_PARAMS (the API's 422, the trainer's
    `model_too_large` error)."""
    return (
        f"{what} has ~{_count(params)} parameters (~{_bytes(4 * params)} as fp32); the "
        f"server allows at most {_count(max_params)} (TORCHYARD_MAX_MODEL_PARAMS)"
    )


def limit_problems(spec: JobSpec, max_params: int, max_data_bytes: int) -> list[tuple[str, str]]:
    """What the spec asks beyond the server's size limits, as (field, message) pairs like
    SpecError's: per-field caps cannot bound products (16 hidden layers of 65536 are each
    allowed; together they are 64 G parameters)."""
    problems: list[tuple[str, str]] = []
    if spec.model is None or spec.data is None:  # a script job: its own business
        return problems
    params = model_parameters(spec)
    if params is not None and params > max_params:
        # Point at what the user chose: an mlp's widths when given, else the model itself.
        field = "model.hidden" if spec.model.name == "mlp" and spec.model.hidden else "model"
        problems.append(
            (
                field,
                f"this model has ~{_count(params)} parameters (~{_bytes(4 * params)} as fp32) "
                f"for data of shape {list(data_shape(spec.data) or ())}; the server allows at most "
                f"{_count(max_params)} (TORCHYARD_MAX_MODEL_PARAMS)",
            )
        )
    nbytes = data_bytes(spec.data)
    if nbytes is not None and nbytes > max_data_bytes:
        problems.append(
            (
                "data",
                f"this data set takes ~{_bytes(nbytes)} on the device (uint8 samples and int64 "
                f"labels); the server allows at most {_bytes(max_data_bytes)} "
                "(TORCHYARD_MAX_DATA_BYTES)",
            )
        )
    return problems
