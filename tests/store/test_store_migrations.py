"""The migrations build exactly the tables of store/models.py, on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from torchyard.store import migrate
from torchyard.store.db import make_engine
from torchyard.store.models import Base

DB_BACKENDS = ("sqlite", "postgres")  # the subject is SQL: tests/BACKENDS.md


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


def test_db_upgrade_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It migrates, saying each migration it ran; run again, it has none to run."""
    from torchyard.settings import get_settings
    from torchyard.store.cli import db_main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    get_settings.cache_clear()
    try:
        assert db_main(["upgrade"]) == 0
        first = capsys.readouterr().err
        assert db_main(["upgrade"]) == 0
        second = capsys.readouterr().err
    finally:
        get_settings.cache_clear()
    assert _diff(url) == []
    ran = [ln for ln in first.splitlines() if ln.startswith("Running upgrade")]
    assert len(ran) == len(set(ran)) > 10 and f" -> {_head()}, " in ran[-1]
    assert "Running upgrade" not in second and f"database at revision {_head()}" in second


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


def _rows(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(text(sql))]
    finally:
        engine.dispose()


def _run(url: str, *statements: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            for sql in statements:
                c.execute(text(sql))
    finally:
        engine.dispose()


def test_projects_migration_moves_existing_jobs_and_sweeps(empty_url: str) -> None:
    """Migration 0016 on a database that has users, jobs and a sweep: each user gets a
    personal project `~<name>` they own, each job and sweep lands in its owner's; the audit
    trail refuses UPDATE and DELETE; a downgrade keeps the jobs."""
    migrate.upgrade(empty_url, "0015")
    now = "'2026-11-01 10:00:00+00:00'"
    _run(
        empty_url,
        f"INSERT INTO users (id, name, is_admin, can_run_code, share, created_at) VALUES "
        f"(1, 'alice', false, false, 1, {now}), (2, 'bob', true, false, 1, {now})",
        *(
            f"INSERT INTO jobs (id, owner_id, name, spec, world_size, priority, preemptible, "
            f"max_restarts, state, attempt, cancel_requested, created_at, updated_at, version) "
            f"VALUES ('{jid}', {owner}, 'j', '{{}}', 1, 0, true, 2, 'succeeded', 1, false, "
            f"{now}, {now}, 0)"
            for jid, owner in (("a" * 32, 1), ("b" * 32, 2), ("c" * 32, 1))
        ),
        f"INSERT INTO sweeps (id, owner_id, name, spec, space, metric, mode, max_trials, "
        f"parallel, sampler, pruner, seed, state, created_at, updated_at) VALUES "
        f"('{'d' * 32}', 2, 's', '{{}}', '{{}}', 'val/loss', 'min', 1, 1, 'random', 'none', 0, "
        f"'running', {now}, {now})",
    )
    migrate.upgrade(empty_url)
    projects = _rows(empty_url, "SELECT id, name, personal_of FROM projects ORDER BY name")
    assert [(n, u) for _, n, u in projects] == [("~alice", 1), ("~bob", 2)]
    ids = {u: i for i, _, u in projects}
    members = _rows(empty_url, "SELECT project_id, user_id, role FROM project_members")
    assert sorted(members) == sorted([(ids[1], 1, "owner"), (ids[2], 2, "owner")])
    jobs = _rows(empty_url, "SELECT id, project_id, tags FROM jobs ORDER BY id")
    assert [(j[:1], p) for j, p, _ in jobs] == [("a", ids[1]), ("b", ids[2]), ("c", ids[1])]
    assert all(t in ([], "[]") for _, _, t in jobs)  # the JSON default, as text on SQLite
    assert _rows(empty_url, "SELECT project_id FROM sweeps") == [(ids[2],)]
    _run(
        empty_url,
        "INSERT INTO audit_log (time, user_name, action, target, details) "
        f"VALUES ({now}, 'bob', 'job.cancel', 'job:x', '{{}}')",
    )
    for sql in ("UPDATE audit_log SET action = 'x'", "DELETE FROM audit_log"):
        with pytest.raises(Exception, match="append-only"):
            _run(empty_url, sql)
    assert _rows(empty_url, "SELECT action FROM audit_log") == [("job.cancel",)]
    migrate.downgrade(empty_url, "0015")
    assert len(_rows(empty_url, "SELECT id FROM jobs")) == 3
    migrate.upgrade(empty_url)
    assert _diff(empty_url) == []


def test_db_upgrade_says_one_line_per_migration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each migration it ran as its revisions and its title (the docstring's heading), not
    the docstring's whole first paragraph; a colon inside `…` or (…) is the title's own."""
    from torchyard.settings import get_settings
    from torchyard.store.cli import db_main

    monkeypatch.setenv("TORCHYARD_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    get_settings.cache_clear()
    try:
        assert db_main(["upgrade"]) == 0
        lines = capsys.readouterr().err.splitlines()
    finally:
        get_settings.cache_clear()
    revisions = ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).walk_revisions()
    assert len(lines) == len(list(revisions)) + 1  # and "database at revision …"
    assert all(ln.startswith("Running upgrade ") for ln in lines[:-1])
    assert "Running upgrade 0003 -> 0004, The job's version" in lines
    assert "Running upgrade 0015 -> 0016, Teams" in lines
    assert ("Running upgrade 0018 -> 0019, Synchronous successive halving (`pruner: halving`, "
            "store/pruning.py)") in lines  # fmt: skip
