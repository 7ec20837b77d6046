"""A model of your own, trained by torchyard's loop: `model.name: "model:build"`.

torchyard calls `build(in_shape=(C, H, W), num_classes=N, **model.args)` on every rank
after seeding torch, so every rank starts from the same weights; return any nn.Module whose
forward takes a batch of inputs and returns logits. AMP, DDP, checkpoints and exact resume
are torchyard's, as for a built-in model.
"""

from __future__ import annotations

from torch import nn


def build(in_shape: tuple[int, ...], num_classes: int, width: int = 32) -> nn.Module:
    """A small all-convolutional network (no fully connected layer but the last)."""
    channels = in_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )
