"""scripts/test.sh installs only the system packages the selected tests need (issue 44, item
13): the rule (scripts/test_needs.py), its table kept in step with the tests that need each
package, test.sh asking it, and the README naming every package test.sh may install."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_SH = ROOT / "scripts" / "test.sh"
EVERYTHING = {"chromium", "nodejs", "npm", "bubblewrap", "prometheus", "slurm-wlm", "munge"}


def _helper() -> ModuleType:
    path = ROOT / "scripts" / "test_needs.py"
    spec = importlib.util.spec_from_file_location("test_needs_helper", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


needs = _helper()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], EVERYTHING),  # CI and the README's full run: everything, as before
        (["-m", "fast"], {"nodejs", "npm", "prometheus"}),  # SSO's hostile test, promtool
        (["-m", "fast and not hostile"], {"prometheus"}),
        (["-mfast", "-k", "quota"], {"nodejs", "npm", "prometheus"}),
        (["-m", "browser"], {"chromium", "nodejs", "npm", "bubblewrap"}),  # + the live page
        (["-m", "browser and not e2e"], {"chromium", "nodejs", "npm"}),
        (["-m", "slurm"], {"slurm-wlm", "munge", "bubblewrap"}),
        (["-m", "chaos", "--chaos-minutes", "30"], {"bubblewrap"}),
        (["-m", "not e2e"], EVERYTHING - {"slurm-wlm", "munge"}),
        (["tests/web"], {"chromium", "nodejs", "npm", "bubblewrap"}),
        (["tests/web/test_dashboard.py::test_x"], {"chromium", "nodejs", "npm", "bubblewrap"}),
        (["tests/store"], set()),
        (["tests/api/test_api_jobs.py", "-x", "-n", "4"], set()),
        (["tests/api/test_sso.py"], {"nodejs", "npm"}),
        (["tests/test_alert_rules.py"], {"prometheus"}),
        (["tests/deploy/test_slurm.py"], {"slurm-wlm", "munge", "bubblewrap"}),
        (["tests/worker", "-m", "not e2e and not hostile"], {"bubblewrap"}),
        (["tests/store", "-m", "browser"], set()),
        (["tests/web", "-m", "fast"], set()),
        (["tests"], EVERYTHING),
        (["."], EVERYTHING),
        ([str(ROOT / "tests" / "web")], {"chromium", "nodejs", "npm", "bubblewrap"}),
        (["-p", "no:cacheprovider", "tests/store"], set()),
    ],
)
def test_the_selected_tests_decide_what_is_installed(args: list[str], expected: set[str]) -> None:
    assert set(needs.packages(args)) == expected


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "marker(x=1)"],  # keyword matching: not read, so everything
        ["-m", "fast and"],
        ["-m", ""],
        ["somewhere_else.py"],
        ["/"],
        ["../other/tests"],
    ],
)
def test_what_cannot_be_read_installs_everything(args: list[str]) -> None:
    assert set(needs.packages(args)) == EVERYTHING


def test_marker_expressions_read_as_pytest_reads_them() -> None:
    assert needs.marker_test("fast", {"fast"})
    assert not needs.marker_test("not fast", {"fast"})
    assert needs.marker_test("e2e and (postgres or redis)", {"e2e", "redis"})
    assert not needs.marker_test("e2e and not (postgres or redis)", {"e2e", "redis"})
    with pytest.raises(needs.Unreadable):
        needs.marker_test("__import__('os')", set())


def _modules_with(pattern: str) -> set[str]:
    rx = re.compile(pattern)
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("*.py")
        if "node_modules" not in p.parts
        and p.name != Path(__file__).name
        and rx.search(p.read_text())
    }


def _where(package: str) -> list[str]:
    return [n.path for n in needs.NEEDS if package in n.packages]


def _covered(module: str, package: str) -> bool:
    return any(module == w or module.startswith(w + "/") for w in _where(package))


def test_the_table_knows_every_test_that_needs_a_package() -> None:
    """A new module that needs a package is where the rule looks for it."""
    checks = {
        "bubblewrap": r"mark\.(e2e|chaos)\b|not support\(\)\.ok",
        "nodejs": r"\boidc_provider\b",
        "chromium": r"\bCHROMIUM\b|chromium",
        "prometheus": r"promtool",
        "slurm-wlm": r"\bslurmlib\b|slurmctld",
    }
    support_files = {"tests/oidc_provider.py", "tests/deploy/slurmlib.py"}
    for package, pattern in checks.items():
        found = {m for m in _modules_with(pattern) if Path(m).name.startswith("test_")}
        missing = sorted(m for m in found - support_files if not _covered(m, package))
        assert not missing, f"{package}: scripts/test_needs.py NEEDS lacks {missing}"
    # Every module the table names is there (a renamed one would silently stop counting).
    for n in needs.NEEDS:
        assert (ROOT / n.path).exists(), n.path


def test_the_helper_prints_one_package_a_line() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "test_needs.py"), "-m", "browser and not e2e"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split("\n") == ["chromium", "nodejs", "npm", ""]


def _decision(*args: str, helper: str = "scripts/test_needs.py") -> set[str]:
    """test.sh's own lines that ask the helper, run on `args`: the packages `want` allows."""
    text = TEST_SH.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("picked=", "want()"))]
    assert len(lines) == 2, lines
    script = "\n".join(["set -euo pipefail", *lines])
    script = script.replace("scripts/test_needs.py", helper)
    script += (
        "\nfor p in " + " ".join(sorted(EVERYTHING)) + '; do want "$p" && echo "$p"; done; true'
    )
    venv_py = ROOT / ".venv" / "bin" / "python"
    script = script.replace(
        ".venv/bin/python", str(venv_py) if venv_py.exists() else sys.executable
    )
    out = subprocess.run(
        ["bash", "-c", script, "test.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_test_sh_installs_what_the_helper_names() -> None:
    assert _decision() == EVERYTHING
    assert _decision("-m", "fast") == {"nodejs", "npm", "prometheus"}
    assert _decision("tests/store") == set()
    # A helper that fails: everything, never nothing.
    assert _decision("tests/store", helper="scripts/no_such_helper.py") == EVERYTHING


def test_every_package_test_sh_installs_is_asked_for() -> None:
    text = TEST_SH.read_text()
    installs = {p for group in re.findall(r"need\+=\(([^)]*)\)", text) for p in group.split()}
    assert installs == set(needs.ALL) == EVERYTHING
    for line in (ln for ln in text.splitlines() if "need+=(" in ln):
        assert line.startswith("want "), line  # each one gated by the rule


def test_the_readme_names_every_package_and_who_needs_it() -> None:
    readme = (ROOT / "README.md").read_text()
    tests = readme.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    for package in needs.ALL:
        assert f"`{package}`" in tests, f"README, Tests, does not name {package}"
    assert "scripts/test_needs.py" in tests
    for n in needs.NEEDS:
        if n.path.endswith(".py"):
            assert n.path.removeprefix("tests/") in tests or n.path in tests, n.path
