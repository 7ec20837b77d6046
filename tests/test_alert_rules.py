"""The alert rules of docs/prometheus/alerts.yml, checked and unit-tested by Prometheus's own
`promtool` (Debian's `prometheus` package; scripts/test.sh installs it): a rule that does
not parse, or fires when it should not, fails here. Without promtool the tests skip, but
fail under CI=true. The metrics the rules read are checked against the names the processes
export, so a renamed metric cannot leave a rule watching nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
RULES = DOCS / "prometheus" / "alerts.yml"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        msg = "promtool is missing: apt-get install prometheus (scripts/test.sh does, as root)"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return exe


def _run(*args: str) -> str:
    done = subprocess.run(
        [_promtool(), *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def test_the_rules_parse() -> None:
    assert "SUCCESS: 4 rules found" in _run("check", "rules", RULES.name)


def test_the_rules_fire_when_they_should_and_only_then() -> None:
    assert "SUCCESS" in _run("test", "rules", "alerts_test.yml")


def test_the_rules_read_metrics_the_processes_export() -> None:
    """Every torchyard_* name in a rule is one scheduler/metrics.py or worker/metrics.py
    defines (and docs/monitoring.md lists)."""
    root = DOCS.parent
    source = (root / "scheduler" / "metrics.py").read_text() + (
        root / "worker" / "metrics.py"
    ).read_text()
    monitoring = (DOCS / "monitoring.md").read_text()
    used = set(re.findall(r"\b(torchyard_(?:scheduler|worker)_[a-z_]+)", RULES.read_text()))
    assert used
    for name in used:
        short = name.removeprefix("torchyard_scheduler_").removeprefix("torchyard_worker_")
        assert f'"{short}"' in source, f"{name}: no such metric in scheduler/ or worker/metrics.py"
        assert name in monitoring, f"{name} is not in docs/monitoring.md"
