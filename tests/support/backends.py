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

The name is DB_BACKENDS: the cluster shapes of end-to-end modules are another list
(tests/support/worker_cluster.py: EMBEDDED, REDIS_POSTGRES, BOTH_SHAPES; `on_shapes` below)."""

from __future__ import annotations

from typing import Any

import pytest

BOTH = ("sqlite", "postgres")
# Where the backend is not the subject (HTTP, permissions, validation, rendering): SQLite.
# A second backend runs every test of the module again (its database is cheap either way:
# a copied file, or a DELETE of every table, ~0.01 s: tests/support/db.py); PostgreSQL's own
# SQL is kept by the modules that declare both.
DEFAULT: tuple[str, ...] = ("sqlite",)
ATTR = "DB_BACKENDS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all-db-backends", action="store_true", default=False,
                     help="the full matrix: modules without DB_BACKENDS on both databases, and "
                          "every test of a two-shape module on both shapes (on_shapes)")  # fmt: skip


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


def on_shapes(*names: str) -> pytest.MarkDecorator:
    """One test's cluster shapes, narrower than its module's BOTH_SHAPES (a test whose
    subject is not what the shapes do differently, in a module whose other tests' is):
    `@on_shapes("embedded")`. Its other cases are deselected (not skipped: they are not
    tests of this run), unless `--all-db-backends` asks for the full matrix."""
    return pytest.mark.on_shapes(*names)


def _shape_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    shapes = [v for v in callspec.params.values() if v in SHAPES]
    return shapes[0] if shapes else None


SHAPES = ("embedded", "redis-postgres")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A PostgreSQL case is marked `postgres` however it was parametrized; a test's cases
    on a shape its `on_shapes` leaves out are deselected."""
    if not config.getoption("--all-db-backends"):
        kept, dropped = [], []
        for item in items:
            mark = item.get_closest_marker("on_shapes")
            shape = _shape_of(item)
            if mark is not None and shape is not None and shape not in mark.args:
                dropped.append(item)
            else:
                kept.append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_pg = callspec is not None and callspec.params.get("db_backend") == "postgres"
        if on_pg and item.get_closest_marker("postgres") is None:
            item.add_marker(pytest.mark.postgres)


@pytest.fixture
def db_backend(request: pytest.FixtureRequest) -> str:
    """The backend this test's database fixtures are on: "sqlite" or "postgres"."""
    return str(request.param)
