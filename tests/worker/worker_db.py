"""The database fixtures the worker and scheduler tests share (each folder's conftest.py
re-exports them): fresh databases, SQLite files or PostgreSQL databases of their own so
other test modules' jobs never reach our scheduler, and a session on them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session
from worker_factories import drop_pg_databases, new_pg_database, sqlite_schema

from torchyard.store.db import dispose_engines, session_factory


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    yield sqlite_schema(tmp_path / "ty.db")
    dispose_engines()


@pytest.fixture
def pg_fresh_url(pg_url: str) -> Iterator[str]:
    make = new_pg_database(pg_url)
    yield make()
    drop_pg_databases(make)


@pytest.fixture
def db_url(db_backend: str, request: pytest.FixtureRequest) -> str:
    """A fresh migrated database on the test's backend (tests/support/backends.py: one,
    unless the module declares both)."""
    if db_backend == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_fresh_url")


@pytest.fixture
def session(db_url: str) -> Iterator[Session]:
    with session_factory(db_url)() as s:
        yield s
