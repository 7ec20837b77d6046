"""Fixtures of the trainer's tests: small data sets in torchvision's on-disk formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_testlib import write_cifar, write_mnist


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cifar(tmp_path_factory.mktemp("cifar"), per_batch=200, n_test=200)


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"), n_train=600, n_test=200, gz=True)


@pytest.fixture(autouse=True)
def _one_thread():
    """In-process runs use one thread: steady timings on a small, shared CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
