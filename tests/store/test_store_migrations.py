"""The migrations build exactly the tables of store/models.py, on both databases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from torchyard.store import migrate
from torchyard.store.db import make_engine
from torchyard.store.models import Base


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    base: str = request.getfixturevalue("pg_url")
    name = f"ty_mig_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _head() -> str:
    """The newest revision in migrations/versions (one head: no branches)."""
    heads = ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_heads()
    assert len(heads) == 1, heads
    return heads[0]


def test_upgrade_from_empty_matches_the_models(empty_url: str) -> None:
    assert migrate.current(empty_url) is None
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == _head()
    assert _tables(empty_url) == set(Base.metadata.tables)
    assert _diff(empty_url) == []
    migrate.upgrade(empty_url)  # idempotent
    migrate.downgrade(empty_url, "base")
    assert _tables(empty_url) == set()
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []


def test_db_upgrade_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchyard.settings import get_settings
    from torchyard.store.cli import db_main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        assert db_main(["upgrade"]) == 0
    finally:
        get_settings.cache_clear()
    assert _diff(url) == []


def test_metric_keys_compare_bytewise_and_reference_nothing(empty_url: str) -> None:
    """Migration 0010 and the models agree where autogenerate does not look (collations):
    the metric tables' text keys are COLLATE "C" on PostgreSQL, and (both databases) no
    foreign key leads from them to `jobs`, before and after a downgrade and upgrade."""
    postgres = empty_url.startswith("postgresql")
    migrate.upgrade(empty_url)
    migrate.downgrade(empty_url, "0009")
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        insp = inspect(engine)
        for table in ("metrics", "metric_blocks"):
            assert insp.get_foreign_keys(table) == []
            columns = {c["name"]: c for c in insp.get_columns(table)}
            for name in ("job_id", "name"):
                model = Base.metadata.tables[table].c[name].type.dialect_impl(engine.dialect)
                assert columns[name]["type"].collation == model.collation  # type: ignore[attr-defined]
                assert model.collation == ("C" if postgres else None)  # type: ignore[attr-defined]
    finally:
        engine.dispose()
