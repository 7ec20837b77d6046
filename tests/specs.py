"""The job specs tests submit, in one place: keyword arguments replace top-level fields.

`digits_spec` trains for real in a second or two (scikit-learn's bundled digits, a small
MLP); `synthetic_spec` needs no data file and is what store and API tests store without
training it."""

from __future__ import annotations

from typing import Any


def digits_spec(**overrides: Any) -> dict[str, Any]:
    """A small, fast real job: digits, an MLP of 32, two epochs of batches of 64."""
    spec: dict[str, Any] = {
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "batch_size": 64,
        "epochs": 2,
    }
    return {**spec, **overrides}


def synthetic_spec(**overrides: Any) -> dict[str, Any]:
    """A tiny job on synthetic data (64 samples of 1x8x8, 4 classes), one epoch."""
    spec: dict[str, Any] = {
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "synthetic", "shape": [1, 8, 8], "num_classes": 4, "size": 64},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "epochs": 1,
    }
    return {**spec, **overrides}
