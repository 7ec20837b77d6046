"""`torchyard api` (api/cli.py): what the server process does before uvicorn serves."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from torchyard.store import migrate


def test_the_server_freezes_its_startup_heap_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full garbage collection over the whole start-up heap took ~45 ms on this machine
    and stalled every request in flight about once a second under load; frozen, only what
    requests allocate is walked (bench/api_bench.py measures the p99)."""
    from torchyard.api import cli

    monkeypatch.setenv("TORCHYARD_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'ty.db'}"
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    migrate.upgrade(url)  # the server waits for its schema (store/migrate.py)
    monkeypatch.setenv("TORCHYARD_SCHEMA_WATCH_S", "0")  # no watch thread in this process
    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:
        seen["frozen"] = gc.get_freeze_count()
        seen["app"], seen["kwargs"] = app, kwargs

    monkeypatch.setattr(uvicorn, "run", fake_run)
    gc.unfreeze()
    try:
        assert cli.main(["--port", "8123"]) == 0
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
    assert seen["frozen"] > 10_000, seen["frozen"]  # the modules, the app, its routes
    assert seen["app"].title == "torchyard"
    assert seen["kwargs"]["port"] == 8123
