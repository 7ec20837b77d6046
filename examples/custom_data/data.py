"""A data set of your own, read by torchyard's loop: `data.name: "data:build"`.

torchyard calls `build(root=<the server's data root as a Path>, **data.args)` and expects
`(train_dataset, val_dataset, num_classes)`: map-style datasets whose items are
`(input_tensor, int_label)`. They go through a DataLoader with a DistributedSampler, so a
job on several workers splits them, and a resumed job continues exactly when the datasets
are deterministic (as this one is: no random augmentation).

This one needs no files: scikit-learn's bundled 8x8 digits, as 1x8x8 float tensors
normalised to [0, 1], with a fixed split. A real one would read from `root`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


class Digits(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


def build(root: Path, val_fraction: float = 0.2) -> tuple[Digits, Digits, int]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return Digits(x[train], y[train]), Digits(x[val], y[val]), 10
