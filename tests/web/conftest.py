"""Browser tests of the dashboard: Playwright driving Debian's chromium (never a browser
Playwright downloads) against a real `torchyard api` process, one browser and one server
per module. Where chromium or the built page is missing they are skipped, except under
CI=true, where they must run and fail loudly instead."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import ROOT

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CHROMIUM = os.environ.get("TORCHYARD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
STATIC = ROOT / "api" / "static" / "index.html"


def _unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"browser tests cannot run: {why} (CI requires them)", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    if not STATIC.exists():
        _unavailable("the dashboard is not built: bash scripts/build_web.sh")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed: pip install -e '.[dev]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def new_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Callable[[], Any]]:
    """Pages in fresh browser contexts (no cookies shared), each failing the test on a
    script error."""
    contexts: list[Any] = []
    errors: list[str] = []

    def make() -> Any:
        ctx = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        contexts.append(ctx)
        page = ctx.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(15_000)
        return page

    yield make
    folder = screenshots(request.config)
    for i, ctx in enumerate(contexts):
        for j, page in enumerate(ctx.pages):
            name = f"{request.node.name}-{i}-{j}.png".replace("/", "_")
            page.screenshot(path=str(folder / name))
        ctx.close()
    assert not errors, f"script errors in the page: {errors}"


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Callable[[Any, str], None]:
    """shot(page, name): keep the page as it looks now as `<name>-<backend>.png` (the
    README's pictures in docs/images/ are these)."""
    folder = screenshots(request.config)
    backend = request.node.callspec.id if hasattr(request.node, "callspec") else "any"

    def take(page: Any, name: str) -> None:
        page.screenshot(path=str(folder / f"{name}-{backend}.png"))

    return take


@pytest.fixture
def keep(
    tmp_path: Path, shot: Callable[[Any, str], None], request: pytest.FixtureRequest
) -> Callable[[Any, str], None]:
    """keep(page, name): a full-page screenshot in the test's tmp dir, copied to the
    module's SHOTS folder (where the lead looks at them), and `shot`'s view of the page."""
    folder = Path(request.module.SHOTS)
    backend = request.node.callspec.id if hasattr(request.node, "callspec") else "any"

    def take(page: Any, name: str) -> None:
        path = tmp_path / f"{name}-{backend}.png"
        page.screenshot(path=str(path), full_page=True)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
        shot(page, name)

    return take


def screenshots(config: pytest.Config) -> Path:
    """Where each test's pages leave their last view: $TORCHYARD_WEB_SCREENSHOTS, else a
    folder in pytest's temporary directory (printed at the end of the run)."""
    folder = getattr(config, "_torchyard_shots", None)
    if folder is None:
        env = os.environ.get("TORCHYARD_WEB_SCREENSHOTS")
        tmp = config._tmp_path_factory  # type: ignore[attr-defined]
        folder = Path(env) if env else tmp.getbasetemp() / "screenshots"
        folder.mkdir(parents=True, exist_ok=True)
        config._torchyard_shots = folder  # type: ignore[attr-defined]
    return folder


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    folder = getattr(config, "_torchyard_shots", None)
    if folder is not None:
        terminalreporter.write_line(f"dashboard screenshots: {folder}")
