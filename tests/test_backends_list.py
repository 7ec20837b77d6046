"""tests/BACKENDS.md stays true: the modules it lists are exactly those that declare both
database backends (DB_BACKENDS, read by tests/support/backends.py), each with its reason;
and the hook runs a module on what it declares, on one backend when it declares nothing."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path
from typing import Any

import pytest
from support import backends

TESTS = Path(__file__).resolve().parent
ROW = re.compile(r"^\| `(tests/[^`]+\.py)` \| (.*) \|$")


SHAPES_TABLE = "| Shape module | Why both |"


def listed(shapes: bool = False) -> dict[str, str]:
    """The rows of the database table, or of the cluster-shape table (`shapes`)."""
    text = (TESTS / "BACKENDS.md").read_text()
    db, shape = text.split(SHAPES_TABLE, 1)
    rows = [ROW.match(line) for line in (shape if shapes else db).splitlines()]
    return {m.group(1): m.group(2).strip() for m in rows if m}


# The two-shape lists a module's cluster fixture may take (worker_cluster, dashboard_lib).
BOTH_SHAPE_LISTS = {"BOTH_SHAPES", "BOTH"}


def on_both_shapes() -> set[str]:
    """The test modules with a fixture parametrized over a two-shape list."""
    out = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        if "node_modules" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                params = [k.value for k in getattr(deco, "keywords", []) if k.arg == "params"]
                if any(isinstance(p, ast.Name) and p.id in BOTH_SHAPE_LISTS for p in params):
                    out.add(f"tests/{path.relative_to(TESTS).as_posix()}")
    return out


def declared() -> dict[str, tuple[str, ...]]:
    """Every test module's DB_BACKENDS, read from its source (a literal tuple)."""
    out: dict[str, tuple[str, ...]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        if "node_modules" in path.parts:
            continue
        name = f"tests/{path.relative_to(TESTS).as_posix()}"
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ImportFrom) and any(
                a.name == backends.ATTR for a in node.names
            ):
                pytest.fail(f"{name} imports {backends.ATTR}: declare it as a literal tuple")
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == backends.ATTR for t in targets):
                value = ast.literal_eval(node.value)  # type: ignore[arg-type]
                assert isinstance(value, tuple), f"{name}: {backends.ATTR} is not a tuple"
                out[name] = value
    return out


def test_the_list_is_the_modules_that_declare_both() -> None:
    both = {m for m, names in declared().items() if set(names) == set(backends.BOTH)}
    rows = listed()
    assert both - rows.keys() == set(), "declare both but are not in tests/BACKENDS.md"
    assert rows.keys() - both == set(), "in tests/BACKENDS.md but do not declare both"
    assert all(reason for reason in rows.values()), "a row of tests/BACKENDS.md has no reason"


def test_the_shape_list_is_the_modules_whose_cluster_runs_on_both() -> None:
    both, rows = on_both_shapes(), listed(shapes=True)
    assert both, "no module runs its cluster on both shapes: the scanner lost them"
    assert both - rows.keys() == set(), "run on both shapes but are not in tests/BACKENDS.md"
    assert rows.keys() - both == set(), "in tests/BACKENDS.md but do not run on both shapes"
    assert all(reason for reason in rows.values()), "a row of tests/BACKENDS.md has no reason"


def test_every_declaration_is_known_backends_and_the_default_is_one() -> None:
    for name, names in declared().items():
        assert names and set(names) <= set(backends.BOTH), f"{name}: {names}"
        assert len(set(names)) == len(names), f"{name}: {names}"
    assert len(backends.DEFAULT) == 1


class _Metafunc:
    """What the hook reads of pytest's Metafunc, and what it asks to parametrize."""

    def __init__(self, module: Any, marks: tuple[Any, ...] = (), all_backends: bool = False):
        self.module = module
        self.fixturenames = ["db_backend", "db_url"]
        self.definition = types.SimpleNamespace(
            nodeid="t.py::test", iter_markers=lambda name: [m.mark for m in marks]
        )
        self.config = types.SimpleNamespace(getoption=lambda name: all_backends)
        self.calls: list[tuple[str, list[Any], bool]] = []

    def parametrize(self, argname: str, params: list[Any], indirect: bool = False) -> None:
        self.calls.append((argname, params, indirect))

    def backends(self) -> list[tuple[str, bool]]:
        """(backend, marked postgres) per case of the one parametrize call."""
        [(argname, params, indirect)] = self.calls
        assert argname == "db_backend" and indirect
        out = []
        for p in params:
            value, marks = (p.values[0], p.marks) if hasattr(p, "values") else (p, ())
            out.append((value, any(m.name == "postgres" for m in marks)))
        return out


def _module(**attrs: Any) -> types.ModuleType:
    module = types.ModuleType("m")
    module.__dict__.update(attrs)
    return module


def test_the_hook_runs_a_module_on_what_it_declares() -> None:
    plain = _Metafunc(_module())
    backends.pytest_generate_tests(plain)  # type: ignore[arg-type]
    assert plain.backends() == [("sqlite", False)]
    both = _Metafunc(_module(DB_BACKENDS=("sqlite", "postgres")))
    backends.pytest_generate_tests(both)  # type: ignore[arg-type]
    assert both.backends() == [("sqlite", False), ("postgres", True)]
    full = _Metafunc(_module(), all_backends=True)  # --all-db-backends
    backends.pytest_generate_tests(full)  # type: ignore[arg-type]
    assert full.backends() == [("sqlite", False), ("postgres", True)]
    pg_only = _Metafunc(_module(DB_BACKENDS=("postgres",)), all_backends=True)
    backends.pytest_generate_tests(pg_only)  # type: ignore[arg-type]
    assert pg_only.backends() == [("postgres", True)]
    narrowed = _Metafunc(_module(DB_BACKENDS=backends.BOTH), marks=(backends.only("postgres"),))
    backends.pytest_generate_tests(narrowed)  # type: ignore[arg-type]
    assert narrowed.calls == []  # the test's own parametrize (with its marker) holds


@pytest.mark.parametrize("bad", [["sqlite", "postgres"], ("mysql",), (), ("sqlite", "sqlite")])
def test_the_hook_refuses_a_bad_declaration(bad: Any) -> None:
    with pytest.raises(pytest.UsageError, match="DB_BACKENDS"):
        backends.pytest_generate_tests(_Metafunc(_module(DB_BACKENDS=bad)))  # type: ignore[arg-type]


def test_the_hook_refuses_a_parametrized_db_url() -> None:
    mark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
    with pytest.raises(pytest.UsageError, match="parametrize db_backend"):
        backends.pytest_generate_tests(_Metafunc(_module(), marks=(mark,)))  # type: ignore[arg-type]
