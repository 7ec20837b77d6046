"""Which database backends a test runs on: one, unless its module says both.

A test that uses `db_url` (or `empty_url`, `session`, `factory`, `settings`, ...) gets the
`db_backend` fixture below, parametrized here per module:

    DB_BACKENDS = ("sqlite", "postgres")  # at module level: this module's subject is SQL

runs each test of the module on both backends; a module without it runs on DEFAULT alone.
The modules that run on both, with why, are listed in tests/BACKENDS.md, and
tests/test_backends_list.py keeps that list and the declarations the same. Test ids stay
`[sqlite]` / `[postgres]`, and a PostgreSQL case carries the `postgres` marker (CI requires
PostgreSQL reachable for those). `--all-db-backends` runs the modules that declare nothing
on both too (the full matrix, as before this choice).

The name is DB_BACKENDS, not BACKENDS: end-to-end modules already import a BACKENDS of
cluster shapes (tests/worker/worker_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest

BOTH = ("sqlite", "postgres")
# Where the backend is not the subject (HTTP, permissions, validation, rendering): SQLite.
# A test's database costs ~0.05 s there against ~0.5-1 s on PostgreSQL (a TRUNCATE of
# every table per test on this 2-core machine), measured on tests/api/test_api_jobs.py and
# test_api_projects.py; PostgreSQL's own SQL is kept by the modules that declare both.
DEFAULT: tuple[str, ...] = ("sqlite",)
ATTR = "DB_BACKENDS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all-db-backends", action="store_true", default=False,
                     help="run the database tests of modules without DB_BACKENDS on both")  # fmt: skip


def module_backends(module: Any) -> tuple[str, ...]:
    """The backends a test module declares (DEFAULT when it declares none)."""
    value = getattr(module, ATTR, DEFAULT)
    if (
        not isinstance(value, tuple)
        or not value
        or len(set(value)) != len(value)
        or not set(value) <= set(BOTH)
    ):
        raise pytest.UsageError(
            f"{module.__name__}.{ATTR} = {value!r}: a tuple of distinct names out of {BOTH}"
        )
    return value


def only(*names: str) -> pytest.MarkDecorator:
    """One test's own backends, narrower than its module's (e.g. PostgreSQL's advisory lock
    in a module that runs on both): `@only("postgres")`."""
    return pytest.mark.parametrize("db_backend", [_param(n) for n in names], indirect=True)


def _param(name: str) -> Any:
    return pytest.param(name, marks=pytest.mark.postgres) if name == "postgres" else name


def _parametrized(metafunc: pytest.Metafunc) -> set[str]:
    names: set[str] = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = argnames.split(",")
        names.update(n.strip() for n in argnames)
    return names


@pytest.hookimpl(tryfirst=True)  # the backend leads the id, as before: [postgres-queued]
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db_backend" not in metafunc.fixturenames:
        return
    explicit = _parametrized(metafunc)
    if explicit & {"db_url", "empty_url"}:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: parametrize db_backend (support.backends.only), "
            "not db_url or empty_url"
        )
    if "db_backend" in explicit:
        return
    names = module_backends(metafunc.module)
    if metafunc.config.getoption("--all-db-backends") and not hasattr(metafunc.module, ATTR):
        names = BOTH  # a module's own declaration (PostgreSQL only, say) still holds
    metafunc.parametrize("db_backend", [_param(n) for n in names], indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A PostgreSQL case is marked `postgres` however it was parametrized."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_pg = callspec is not None and callspec.params.get("db_backend") == "postgres"
        if on_pg and item.get_closest_marker("postgres") is None:
            item.add_marker(pytest.mark.postgres)


@pytest.fixture
def db_backend(request: pytest.FixtureRequest) -> str:
    """The backend this test's database fixtures are on: "sqlite" or "postgres"."""
    return str(request.param)
