"""Where the suite's time goes: `--timing-report PATH` writes, at the end of a run, the
seconds spent per module (setup, call and teardown of its tests) and per fixture setup
(summed over every time it was set up), and prints the top of both. Plain pytest gives
the per-test table (`--durations=0`); this adds the sums a suite is cut by."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_modules: dict[str, float] = defaultdict(float)
_tests: dict[str, float] = defaultdict(float)
_fixtures: dict[str, float] = defaultdict(float)
_fixture_counts: dict[str, int] = defaultdict(int)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timing-report", default=None, metavar="PATH",
                     help="write seconds per module and per fixture setup as JSON")  # fmt: skip


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _modules[module] += report.duration
    _tests[report.nodeid] += report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Generator[None, None, None]:
    t0 = time.perf_counter()
    yield
    key = f"{fixturedef.baseid or '.'}::{fixturedef.argname} ({fixturedef.scope})"
    _fixtures[key] += time.perf_counter() - t0
    _fixture_counts[key] += 1


class _FromWorkers:
    """Under pytest-xdist the test reports reach the controller, but fixtures are set up in
    the workers: each sends its sums back in `workeroutput`, added up here."""

    @staticmethod
    def pytest_testnodedown(node: Any, error: Any) -> None:
        sent = getattr(node, "workeroutput", {}).get("timing_fixtures", {})
        for key, (s, n) in sent.items():
            _fixtures[key] += s
            _fixture_counts[key] += n


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--timing-report") and config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_FromWorkers(), "timing-from-workers")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--timing-report")
    if not path:
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller writes the report
        workeroutput["timing_fixtures"] = {k: (v, _fixture_counts[k]) for k, v in _fixtures.items()}
        return
    top = sorted(_modules.items(), key=lambda kv: -kv[1])
    fixtures = sorted(_fixtures.items(), key=lambda kv: -kv[1])
    tests = sorted(_tests.items(), key=lambda kv: -kv[1])
    Path(path).write_text(json.dumps({
        "modules": dict(top),
        "fixtures": {k: {"s": v, "setups": _fixture_counts[k]} for k, v in fixtures},
        "tests": dict(tests),
    }, indent=1))  # fmt: skip


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not config.getoption("--timing-report"):
        return
    tr = terminalreporter
    tr.write_sep("=", "slowest modules (s, setup+call+teardown)")
    for name, s in sorted(_modules.items(), key=lambda kv: -kv[1])[:20]:
        tr.write_line(f"{s:8.1f}  {name}")
    tr.write_sep("=", "slowest fixture setups (s summed, setups)")
    for name, s in sorted(_fixtures.items(), key=lambda kv: -kv[1])[:15]:
        tr.write_line(f"{s:8.1f}  {_fixture_counts[name]:4d}  {name}")
