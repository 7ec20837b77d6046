"""A torchvision build's time budget is the building thread's CPU time (BUILD_S), backed
by a wall-clock bound (BUILD_WALL_S): a loaded host slows a build down without making it
cost more, and refused a valid spec as "takes more than 5 s" when only the wall clock was
counted (seen with the test suite in three processes on two cores)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from torchyard.scheduler import modelsize


@pytest.fixture
def building() -> Iterator[Any]:
    b = modelsize._in_build
    b.active, b.modules = True, 0
    b.cpu_deadline = time.thread_time() + 60
    b.deadline = time.monotonic() + 60
    yield b
    b.active = False


def test_a_build_past_its_cpu_budget_is_refused(building: Any) -> None:
    building.cpu_deadline = time.thread_time() - 0.001
    with pytest.raises(modelsize.BuildRefused, match=f"takes more than {modelsize.BUILD_S:g} s"):
        modelsize._on_registration()


def test_a_build_waiting_for_the_cpu_is_not_refused_until_the_wall_bound(
    building: Any,
) -> None:
    # Wall time passes (the thread sleeps, as a starved thread waits); no CPU is spent.
    building.deadline = time.monotonic() + 0.3
    building.cpu_deadline = time.thread_time() + 0.05
    time.sleep(0.2)
    modelsize._on_registration()  # 0.2 s of wall, almost no CPU: within both
    time.sleep(0.2)
    with pytest.raises(modelsize.BuildRefused, match=r"took more than \d+ s on this host"):
        modelsize._on_registration()


def test_the_wall_bound_is_above_the_cpu_budget() -> None:
    assert modelsize.BUILD_WALL_S > modelsize.BUILD_S
