"""Hostile tenants, issue 25: every service process makes its files and folders private to
its user (umask 077) before it creates any: the API, the scheduler, each worker and `up`
(the home, the database, the broker's messages, logs and run directories)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchyard import settings as settings_module
from torchyard import up
from torchyard.api import cli as api_cli
from torchyard.scheduler import cli as scheduler_cli
from torchyard.worker import cli as worker_cli

pytestmark = pytest.mark.hostile


class Started(Exception):
    """Raised by the stand-in for a service's first step, once it saw the umask."""


@pytest.fixture(autouse=True)
def _restore_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _seen() -> tuple[list[int], Callable[..., None]]:
    masks: list[int] = []

    def first_step(*args: object, **kwargs: object) -> None:
        mask = os.umask(0)
        os.umask(mask)
        masks.append(mask)
        raise Started

    return masks, first_step


@pytest.fixture(autouse=True)
def _restore_umask() -> Iterator[None]:
    """The services set the process's umask: the tests after these keep their own."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.mark.parametrize("service", ["api", "scheduler", "worker", "up"])
def test_every_service_starts_with_a_private_umask(
    service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    masks, first_step = _seen()
    if service == "api":
        monkeypatch.setattr(settings_module, "get_settings", first_step)
        call: Callable[[], object] = lambda: api_cli.main([])  # noqa: E731
    elif service == "scheduler":
        monkeypatch.setattr(scheduler_cli, "load_settings", first_step)
        call = lambda: scheduler_cli.main([])  # noqa: E731
    elif service == "worker":
        monkeypatch.setattr(worker_cli, "load_settings", first_step)
        call = lambda: worker_cli.worker_main(["--device", "cpu"])  # noqa: E731
    else:
        monkeypatch.setattr(up, "Up", lambda args: type("U", (), {"run": first_step})())
        call = lambda: up.main([])  # noqa: E731
    with pytest.raises(Started):
        call()
    assert masks == [0o077], f"{service} started with umask {oct(masks[0]) if masks else None}"


def test_a_file_made_under_it_is_the_users_alone(tmp_path: Path) -> None:
    settings_module.private_umask()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "d" / "f").stat().st_mode & 0o777 == 0o600
