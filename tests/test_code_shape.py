"""The shape rules of docs/architecture.md ("Code rules"), read from the source with `ast`:
every module outside tests opens with a docstring saying what it owns, no function
outside tests is over 60 lines, and no module under tests/ edits sys.path (what suites
share is the package tests/support, imported as `support.…`). Each exemption names why
it is one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"tests", ".venv", ".git", "node_modules", ".torchyard", "build", "dist"}
MAX_LINES = 60

# (file, function): why it may be longer.
LONG_ALLOWED = {
    # Alembic's first schema: one op.create_table per table, declarative, never edited again.
    ("migrations/versions/0001_initial_schema.py", "upgrade"),
    # The seed article's MNIST loop kept in its own shape, so a reader can set the two side
    # by side (the example's docstring says what changed).
    ("examples/script_mnist/train.py", "main"),
}


def _sources() -> list[Path]:
    return sorted(
        p for p in ROOT.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
    )


def _long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


def test_the_walk_sees_the_tree() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"trainer/loop.py", "store/jobs.py", "api/app.py", "worker/supervisor.py"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_every_module_says_what_it_owns() -> None:
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in _sources()
        if ast.get_docstring(ast.parse(p.read_text(), str(p))) is None
    ]
    assert missing == [], f"modules without a docstring: {missing}"


def test_no_function_is_over_60_lines() -> None:
    found = {
        (p.relative_to(ROOT).as_posix(), name): length
        for p in _sources()
        for name, length in _long_functions(ast.parse(p.read_text(), str(p)))
    }
    over = {k: v for k, v in found.items() if k not in LONG_ALLOWED}
    assert over == {}, f"functions over {MAX_LINES} lines (split them): {over}"
    stale = LONG_ALLOWED - found.keys()
    assert stale == set(), f"exemptions no longer needed (remove them): {stale}"


def test_the_length_check_catches_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"def long():\n{body}\n\nasync def short():\n    pass\n")
    assert _long_functions(tree) == [("long", MAX_LINES + 1)]


# Files under tests/ that may put a folder on sys.path: why.
SYS_PATH_ALLOWED = {
    # A user's code folder first on sys.path, as the trainer puts it, is what it tests.
    "tests/trainer/test_load_model.py",
}


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _edits_sys_path(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):  # sys.path.insert(…), .append(…), .extend(…)
        f = node.func
        return (
            isinstance(f, ast.Attribute)
            and f.attr in {"insert", "append", "extend"}
            and _is_sys_path(f.value)
        )
    if isinstance(node, ast.Assign | ast.AugAssign):  # sys.path = …, sys.path[:0] = …, +=
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(
            _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value))
            for t in targets
        )
    # `from sys import path`: edited under another name
    return (
        isinstance(node, ast.ImportFrom)
        and node.module == "sys"
        and any(a.name == "path" for a in node.names)
    )


def _sys_path_edits(tree: ast.AST) -> list[int]:
    """The lines that edit sys.path (_edits_sys_path)."""
    return sorted(n.lineno for n in ast.walk(tree) if _edits_sys_path(n))  # type: ignore[attr-defined]


def test_no_test_edits_sys_path() -> None:
    """A helper shared across suites lives in tests/support (`from support.x import …`);
    one beside its only users is found there by pytest's own rootdir insertion."""
    found = {}
    for p in sorted((ROOT / "tests").rglob("*.py")):
        if "node_modules" in p.parts:
            continue
        lines = _sys_path_edits(ast.parse(p.read_text(), str(p)))
        if lines:
            found[p.relative_to(ROOT).as_posix()] = lines
    edits = {k: v for k, v in found.items() if k not in SYS_PATH_ALLOWED}
    assert edits == {}, f"sys.path edited under tests/ (move the helper to tests/support): {edits}"
    stale = SYS_PATH_ALLOWED - found.keys()
    assert stale == set(), f"exemptions no longer needed (remove them): {stale}"


def test_the_sys_path_check_catches_an_edit() -> None:
    source = (
        "import sys\n"
        "sys.path.insert(0, 'a')\n"
        "sys.path.append('b')\n"
        "def f():\n    sys.path[:0] = ['c']\n"
        "sys.path += ['d']\n"
        "from sys import path\n"
        "sys.path.remove('a')\n"  # undoing an edit is none
        "note = 'sys.path.insert(0, 1)'\n"  # nor is text that says one
        "other.path.insert(0, 'e')\n"
    )
    assert _sys_path_edits(ast.parse(source)) == [2, 3, 5, 6, 7]
