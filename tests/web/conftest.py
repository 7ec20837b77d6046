"""Browser tests of the dashboard: Playwright driving Debian's chromium (never a browser
Playwright downloads) against a real `torchyard api` process, one browser and one server
per module. Where chromium or the built page is missing they are skipped, except under
CI=true, where they must run and fail loudly instead."""

from __future__ import annotations

import os
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
    shots = os.environ.get("TORCHYARD_WEB_SCREENSHOTS")  # a folder: keep each page's last view
    for i, ctx in enumerate(contexts):
        for j, page in enumerate(ctx.pages if shots else []):
            name = f"{request.node.name}-{i}-{j}.png".replace("/", "_")
            page.screenshot(path=os.path.join(shots, name), full_page=True)
        ctx.close()
    assert not errors, f"script errors in the page: {errors}"
