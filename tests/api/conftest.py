"""API fixtures: an app on the test's database (tests/support/db.py), a client, tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.app import create_app
from torchyard.settings import Settings


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
