"""API fixtures: an app on each database backend, a client, tokens."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from torchyard.api.app import create_app
from torchyard.settings import Settings

# The database fixtures live beside the store tests; both suites share them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))

import torchyard_testdb as _db
from torchyard_testdb import Factory

# The shared database fixtures (re-exported so pytest finds them here).
db_url = _db.db_url
factory = _db.factory
pg_migrated = _db.pg_migrated
session = _db.session
settings = _db.settings
sqlite_template = _db.sqlite_template


@pytest.fixture
def app(settings: Settings):  # type: ignore[no-untyped-def]
    app = create_app(settings)
    app.state.feed_poll_s = 0.02
    return app


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(app) as c:
        yield c


@pytest.fixture
def alice(factory: Factory) -> dict[str, str]:
    return {"Authorization": f"Bearer {factory.token('alice')}"}


@pytest.fixture
def bob(factory: Factory) -> dict[str, str]:
    return {"Authorization": f"Bearer {factory.token('bob')}"}


@pytest.fixture
def admin(factory: Factory) -> dict[str, str]:
    return {"Authorization": f"Bearer {factory.token('root', admin=True)}"}
