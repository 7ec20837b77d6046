"""Which system packages `scripts/test.sh` installs for the tests its arguments select: the
rule, in one place (scripts/test.sh asks it; tests/test_test_needs.py holds it; README, Tests,
lists the packages and the tests that need each).

    python scripts/test_needs.py [PYTEST ARGS...]   # prints the Debian packages, one a line

No arguments (CI's `.ci/run`, the README's full run): every package. Otherwise a package is
installed when some test that needs it could be selected: a path argument overlaps where
those tests live (`tests/web` needs chromium, `tests` everything) and the `-m`
expression, if any, can be true for the markers those tests carry (`-m fast` selects no
browser or Slurm test, `-m browser` no Slurm one). What cannot be read (an odd path, an
expression we do not parse) installs everything: too much costs minutes, too little a
skipped test (a failed one under CI). `-k` and the other options only narrow a selection,
and are not read. Standard library only: it runs before anything else is known to work."""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The markers a test carries that `-m` may name (pyproject.toml's list; `fast` is set by
# tests/support/lanes.py on every test not slow by kind or module).
E2E_PROFILES: tuple[set[str], ...] = (
    {"e2e"},
    {"e2e", "gpu"},
    {"e2e", "hostile"},
    {"e2e", "hostile", "postgres", "redis"},
    {"e2e", "postgres"},
    {"e2e", "postgres", "redis"},
    {"e2e", "slurm"},
    {"browser", "e2e"},
    {"chaos"},
)
# Where the end-to-end and chaos modules live (tests/test_test_needs.py keeps it so).
E2E_FOLDERS = (
    "tests/chaos",
    "tests/client",
    "tests/deploy",
    "tests/scheduler",
    "tests/trainer",
    "tests/web",
    "tests/worker",
)
SSO = ("tests/api/test_sso.py", "tests/api/test_hostile_sso.py", "tests/client/test_client_sso.py")
SANDBOX = (
    "tests/worker/test_sandbox.py",
    "tests/worker/test_zygote.py",
    "tests/worker/test_hostile_tenants.py",
    "tests/worker/test_hostile_sandbox.py",
)
SANDBOX_PROFILES: tuple[set[str], ...] = (
    set(),
    {"hostile"},
    {"hostile", "postgres"},
    {"e2e", "hostile"},
)


@dataclass(frozen=True)
class Need:
    """Tests under `path` (a folder or a module) carrying one of `profiles` need `packages`."""

    packages: tuple[str, ...]
    path: str
    profiles: tuple[set[str], ...]


NEEDS = (
    # The dashboard's browser tests: Debian's chromium, and Node to build the page.
    Need(("chromium", "nodejs", "npm"), "tests/web", ({"browser"}, {"browser", "e2e"})),
    # Single sign-on: a real OpenID provider (node-oidc-provider, tests/oidc_provider.py).
    *(Need(("nodejs", "npm"), p, (set(), {"fast", "hostile"})) for p in SSO),
    # The trainer's sandbox (worker/sandbox.py): its own tests, and every end-to-end or chaos
    # test, whose workers sandbox trainers (TORCHYARD_SANDBOX=on) and refuse user code without.
    *(Need(("bubblewrap",), p, SANDBOX_PROFILES) for p in SANDBOX),
    *(Need(("bubblewrap",), f, E2E_PROFILES) for f in E2E_FOLDERS),
    # promtool, for the alert rules.
    Need(("prometheus",), "tests/test_alert_rules.py", ({"fast"},)),
    # The Slurm test's own munged, slurmctld and slurmd.
    Need(("slurm-wlm", "munge"), "tests/deploy/test_slurm.py", ({"e2e", "slurm"},)),
)
ALL = tuple(dict.fromkeys(p for n in NEEDS for p in n.packages))


class Unreadable(ValueError):
    """An argument the rule cannot interpret: install everything."""


def marker_test(expr: str, markers: set[str]) -> bool:
    """Whether pytest's `-m expr` is true for a test carrying `markers` (and, or, not,
    parentheses and marker names; anything else is Unreadable)."""
    words = re.findall(r"\(|\)|[^\s()]+", expr)
    if not words:
        raise Unreadable(f"-m {expr!r}")
    out = []
    for w in words:
        if w in ("and", "or", "not", "(", ")"):
            out.append(w)
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", w):
            out.append(str(w in markers))
        else:
            raise Unreadable(f"-m {expr!r}")
    try:
        tree = ast.parse(" ".join(out), mode="eval")
    except SyntaxError:
        raise Unreadable(f"-m {expr!r}") from None
    allowed = (ast.Expression, ast.BoolOp, ast.UnaryOp, ast.And, ast.Or, ast.Not, ast.Constant)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise Unreadable(f"-m {expr!r}")
    return bool(eval(compile(tree, "<-m>", "eval"), {"__builtins__": {}}))


def _rel(arg: str, root: Path) -> str:
    """A path argument (a node id's file part) relative to the repository root."""
    path = arg.split("::", 1)[0]
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(root)
        except ValueError:
            raise Unreadable(path) from None
    rel = os.path.normpath(p).replace(os.sep, "/")
    if rel.startswith(".."):
        raise Unreadable(path)
    return "" if rel == "." else rel


def read_args(args: Sequence[str], root: Path = ROOT) -> tuple[list[str], str | None]:
    """The paths the arguments select and the last `-m` expression. A word after another
    option is that option's value (`-k NAME`, `-n 4`), unless it names a test path."""
    paths: list[str] = []
    expr: str | None = None
    after_option = False
    it = iter(args)
    for a in it:
        if a in ("-m", "--markexpr"):
            expr, after_option = next(it, ""), False
        elif a.startswith("--markexpr="):
            expr, after_option = a.split("=", 1)[1], False
        elif a.startswith("-m") and not a.startswith("--"):
            expr, after_option = a[2:], False
        elif a.startswith("-"):
            after_option = "=" not in a
        else:
            looks_like_path = a.startswith(("tests", "./", "/")) or a in (".", "..") or "::" in a
            if looks_like_path or (root / a.split("::", 1)[0]).exists():
                paths.append(_rel(a, root))
            elif not after_option:
                raise Unreadable(a)
            after_option = False
    return paths, expr


def _overlaps(arg: str, where: str) -> bool:
    return arg == "" or arg == where or arg.startswith(where + "/") or where.startswith(arg + "/")


def packages(args: Sequence[str], root: Path = ROOT) -> list[str]:
    """The Debian packages the tests that `args` select may need, in NEEDS's order."""
    if not args:
        return list(ALL)
    try:
        paths, expr = read_args(args, root)
        wanted = {
            pkg
            for need in NEEDS
            if not paths or any(_overlaps(p, need.path) for p in paths)
            if expr is None or any(marker_test(expr, prof) for prof in need.profiles)
            for pkg in need.packages
        }
    except Unreadable:
        return list(ALL)
    return [p for p in ALL if p in wanted]


if __name__ == "__main__":
    print("\n".join(packages(sys.argv[1:])))
