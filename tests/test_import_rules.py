"""The import rules of docs/architecture.md, read from the source with `ast` (every import statement,
also inside functions and `if TYPE_CHECKING:`, and importlib.import_module("literal")).

Each part may import only the parts of ours listed in ALLOWED (and itself):

- `contracts` (spec, events, exit codes, states) imports pydantic and the standard library
  only: every part, the trainer and the client included, reads it without torch.
- `trainer` imports only `contracts` and `torchyard.job` (the module a script job's own code
  talks to, whose backend the trainer installs) of ours, and no service library (fastapi,
  celery, sqlalchemy, redis, kombu, …): it runs under plain torchrun.
- `torchyard/job.py` imports torch and the standard library only at module level (and
  safetensors inside a function), so that a user's script needs nothing else of ours.
- `torchyard/settings.py` (the one settings object) imports nothing of ours.
- `storage` (where a run's files live) imports `contracts` and the settings.
- `store` sits below every service: `contracts`, `storage` and the settings, never
  `trainer`, `api`, `worker`, `broker`, `scheduler` nor `client`.
- `broker` (the Celery app and the embedded transport) imports the settings only.
- `scheduler` (the pool: admission, the scheduling pass, the sweep controller, its process)
  imports `store`, `storage`, `broker`, `contracts` and the settings.
- `api` and `worker` import those too (the api also `scheduler`), never each other and
  never the trainer: a CUDA fault in training cannot take a worker down.
- `client` speaks HTTP: of ours it imports `contracts` only.
- Every part is installed and imported under the one `torchyard` namespace (the repository's
  `trainer/` folder is `torchyard.trainer`): no file imports a bare `trainer`, `store`, ….

Rules are written with the part's short name: `torchyard.contracts.spec` is read as
`contracts.spec`, `torchyard.settings` as `torchyard.settings`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = {"trainer", "store", "api", "worker", "client", "migrations", "broker", "scheduler",
         "contracts", "storage"}  # fmt: skip
# (folders = subpackages)
OURS = PARTS | {"torchyard"}
SERVICE_LIBS = {"fastapi", "starlette", "uvicorn", "celery", "kombu", "sqlalchemy", "alembic",
                "redis", "psycopg", "psycopg2", "pydantic_settings"}  # fmt: skip
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    module: str  # absolute dotted name, `torchyard.` dropped before one of PARTS
    raw: str = ""  # the name as written

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}"


def _module_name(path: Path) -> str:
    """The installed name: api/app.py is torchyard.api.app."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] in PARTS:
        parts.insert(0, "torchyard")
    return ".".join(parts)


def _short(name: str) -> str:
    """torchyard.contracts.spec -> contracts.spec (what the rules are written in)."""
    head, _, rest = name.partition(".")
    if head == "torchyard" and rest.split(".")[0] in PARTS:
        return rest
    return name


def _is_our_module(name: str) -> bool:
    p = REPO.joinpath(*_short(name).split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imp(path: Path, line: int, name: str) -> Import:
    return Import(path, line, _short(name), name)


def imports_of(path: Path, me: str | None = None) -> list[Import]:
    """Every module a file imports, as absolute names (`from trainer import spec` → trainer.spec).
    `me` is the file's dotted module name (default: from its place in the repo)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = me or _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [_imp(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.append(_imp(path, node.lineno, sub if _is_our_module(sub) else mod))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("__import__", "import_module")
                )
            )
        ):
            found.append(_imp(path, node.lineno, node.args[0].value))
    return found


def package_imports(package: str) -> list[Import]:
    root = REPO / package
    assert (root / "__init__.py").is_file(), f"{package}/ is missing"
    return [i for f in sorted(root.rglob("*.py")) for i in imports_of(f)]


def _violations(imports: list[Import], bad) -> list[str]:
    return [str(i) for i in imports if bad(i)]


SETTINGS, JOB = "torchyard.settings", "torchyard.job"
ALLOWED: dict[str, set[str]] = {
    "contracts": set(),
    "trainer": {"contracts", JOB},
    "storage": {"contracts", SETTINGS},
    "store": {"contracts", "storage", SETTINGS},
    "broker": {SETTINGS},
    "scheduler": {"contracts", "store", "storage", "broker", SETTINGS},
    "api": {"contracts", "store", "storage", "broker", "scheduler", SETTINGS},
    "worker": {"contracts", "store", "storage", "broker", SETTINGS},
    "client": {"contracts"},
    "migrations": {"contracts", "store", SETTINGS},
}
"""Of ours, what each part may import besides itself."""


def _allowed(part: str, i: Import) -> bool:
    if i.top not in OURS or i.top == part:
        return True
    return any(i.module == a or i.module.startswith(f"{a}.") or i.top == a for a in ALLOWED[part])


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_the_parts_below_it(part: str) -> None:
    found = package_imports(part)
    assert found, "parsed nothing"
    bad = _violations(found, lambda i: not _allowed(part, i))
    assert not bad, f"{part} may import {sorted(ALLOWED[part])} of ours:\n" + "\n".join(bad)


@pytest.mark.parametrize("part", ["trainer", "contracts"])
def test_trainer_and_contracts_import_no_service_library(part: str) -> None:
    bad = _violations(package_imports(part), lambda i: i.top in SERVICE_LIBS)
    assert not bad, "\n".join(bad)


def test_the_settings_module_imports_nothing_of_ours() -> None:
    bad = _violations(imports_of(REPO / "torchyard" / "settings.py"), lambda i: i.top in OURS)
    assert not bad, "\n".join(bad)


def _top_level_imports(path: Path) -> list[Import]:
    """The imports a module runs when it is imported: its top-level statements (also inside
    top-level `if`/`try`), not those inside functions or classes."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    todo, found = list(tree.body), []
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [_imp(path, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(_imp(path, node.lineno, node.module or ""))
        elif isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return found


def test_the_job_module_imports_only_torch_and_the_standard_library() -> None:
    """`torchyard.job` is what a user's script imports, also run by hand: torch and the
    standard library at import time; safetensors only inside the function that needs it."""
    path = REPO / "torchyard" / "job.py"
    top = _top_level_imports(path)
    assert top, "parsed nothing"
    bad = _violations(top, lambda i: i.top not in STDLIB | {"torch"})
    assert not bad, "\n".join(bad)
    bad = _violations(imports_of(path), lambda i: i.top not in STDLIB | {"torch", "safetensors"})
    assert not bad, "\n".join(bad)
    code = (
        "import sys, torchyard.job; "
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('torchyard.', "
        "'safetensors', 'pydantic')) and m != 'torchyard.job')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loaded: {out.stdout.strip()}"


PYDANTIC = {"pydantic", "pydantic_core"}


@pytest.mark.parametrize(
    "module", [*sorted(p.name for p in (REPO / "contracts").glob("*.py")), "trainer/__init__.py"]
)
def test_contracts_are_torch_free(module: str) -> None:
    """Every contracts module (and the trainer's package file) imports pydantic and the
    standard library only, so the API, the worker and the client load them without torch."""
    path = REPO / module if "/" in module else REPO / "contracts" / module
    allowed = STDLIB | PYDANTIC if "/" not in module else STDLIB
    bad = _violations(imports_of(path), lambda i: i.top not in allowed | {"contracts"})
    assert not bad, "\n".join(bad)


def test_contracts_load_without_torch() -> None:
    """The same rule, run: importing every contracts module must not pull torch in."""
    code = (
        "import sys, pkgutil, importlib, torchyard.contracts as c; "
        "[importlib.import_module(f'torchyard.contracts.{m.name}') "
        "for m in pkgutil.iter_modules(c.__path__)]; "
        "heavy = sorted(m for m in ('torch', 'numpy', 'torchvision') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loaded: {out.stdout.strip()}"


def test_client_imports_nothing_server_side() -> None:
    found = package_imports("client")
    server = {"store", "api", "worker", "trainer", "torch", "torchvision"} | SERVICE_LIBS
    bad = _violations(found, lambda i: i.top in server)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_what_it_must(tmp_path: Path) -> None:
    """The parser itself: relative imports, `from pkg import submodule`, imports inside
    functions and importlib.import_module with a literal."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom torchyard.contracts import exitcodes\nfrom . import data\n"
        "from .models import mlp\n"
        "def f():\n    import sqlalchemy.orm\n    import importlib\n"
        "    return importlib.import_module('celery')\n"
    )
    found = {i.module for i in imports_of(sample, me="torchyard.trainer.sample")}
    assert found == {"os", "contracts.exitcodes", "trainer.data", "trainer.models",
                     "sqlalchemy.orm", "importlib", "celery"}  # fmt: skip


def test_every_import_of_ours_goes_through_the_torchyard_namespace() -> None:
    """A bare `import trainer` works only from the repository root, and would pick up a
    user's own `trainer/` anywhere else."""
    files = [f for part in sorted(OURS) for f in sorted((REPO / part).rglob("*.py"))]
    files += sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
    bare = [f"{f}:{i.line} imports {i.raw}" for f in files for i in imports_of(f)
            if i.raw.split(".")[0] in PARTS]  # fmt: skip
    assert not bare, "\n".join(bare)


def test_a_users_own_trainer_and_client_do_not_shadow_torchyard(tmp_path: Path) -> None:
    """The trainer runs with the job's directory as its cwd (first on sys.path): a user's
    `trainer/` package and `client.py` there must not replace ours, nor ours theirs."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("MINE = 'user trainer'\n")
    (tmp_path / "client.py").write_text("MINE = 'user client'\n")
    code = (
        "import trainer, client, torchyard.contracts.spec as s, torchyard.client.sdk as c; "
        "print(trainer.MINE, '|', client.MINE, '|', s.JobSpec.__name__, c.Client.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={"PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "user trainer | user client | JobSpec Client"
