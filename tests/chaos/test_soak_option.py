"""`--chaos-minutes N` gives the chaos test time for its soak (tests/conftest.py): under the
suite's own 600 s per-test timeout, any soak of more than about 7 minutes was killed
before its checks ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTER = """
def pytest_collection_finish(session):
    for item in session.items:
        marker = item.get_closest_marker("timeout")
        print("TIMEOUT", item.name, marker.args[0] if marker else None)
"""


def _timeouts(tmp_path: Path, *args: str) -> dict[str, float | None]:
    (tmp_path / "timeout_reporter.py").write_text(REPORTER)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "timeout_reporter", "-m", "chaos", "tests/chaos/test_chaos.py", *args],
        cwd=ROOT, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("TIMEOUT "):
            _, name, value = line.split()
            found[name] = None if value == "None" else float(value)
    assert found, out.stdout
    return found


def test_a_soak_gets_its_minutes_plus_the_allowance(tmp_path: Path) -> None:
    assert set(_timeouts(tmp_path, "--chaos-minutes", "30").values()) == {30 * 60 + 600.0}


def test_the_bounded_run_keeps_the_suites_timeout(tmp_path: Path) -> None:
    assert set(_timeouts(tmp_path).values()) == {None}  # pyproject's 600 s applies
