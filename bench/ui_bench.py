"""The dashboard's figures, in headless chromium against a real `torchyard api`:

- the page's JavaScript, gzipped (what the build wrote: api/static/build.json);
- time to first chart for a job with a 1,000,000-point curve (one 100x spike): from the
  navigation's start to the chart drawn (the page's `ty-first-chart` mark), and whether the
  spike is in the drawn band;
- time to the first table of a user with 10,000 jobs, from the navigation's start.

Each page is loaded RUNS times in a fresh browser context (the session cookie set once);
medians are printed. Needs chromium (/usr/bin/chromium) and the built dashboard.

    python bench/ui_bench.py [--points 1000000] [--jobs 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import ROOT, start_api

sys.path.insert(0, str(ROOT / "tests" / "web"))

from seed import long_curve_job, many_jobs, user_id

from torchyard.store.auth import create_token
from torchyard.store.db import session_scope

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _seed(url: str, points: int, jobs: int) -> tuple[str, str, str]:
    """(alice's token, the long job's id, carol's token)."""
    t = time.monotonic()
    with session_scope(url) as s:
        alice, carol = user_id(s, "alice"), user_id(s, "carol")
        job = long_curve_job(s, alice, "long-run", points, spike_at=points * 7 // 10 + 1)
        many_jobs(s, carol, jobs)
        tokens = create_token(s, "alice"), create_token(s, "carol")
    print(f"seeded {points:,} points and {jobs:,} jobs in {time.monotonic() - t:.1f}s")
    return tokens[0], job, tokens[1]


def _logged_in(browser: Any, base: str, token: str) -> list[dict[str, Any]]:
    """The session cookie of a token login (made once, outside the timings)."""
    ctx = browser.new_context()
    r = ctx.request.post(base + "/v1/ui/sessions", data="{}", headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})  # fmt: skip
    assert r.status == 201, r.text()
    cookies: list[dict[str, Any]] = ctx.cookies()
    ctx.close()
    return cookies


def _time_page(browser: Any, cookies: list[dict[str, Any]], url: str, ready: str, mark: str | None) -> float:  # fmt: skip
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    ctx.add_cookies(cookies)
    page = ctx.new_page()
    page.goto(url)
    page.wait_for_selector(ready, timeout=60_000)
    if mark:
        ms = page.evaluate(f"() => performance.getEntriesByName('{mark}')[0].startTime")
    else:
        ms = page.evaluate("() => performance.now()")
    ctx.close()
    return float(ms) / 1000


def _spike_drawn(browser: Any, cookies: list[dict[str, Any]], url: str) -> dict[str, Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    ctx.add_cookies(cookies)
    page = ctx.new_page()
    page.goto(url)
    page.wait_for_selector(".chart[data-group='loss'][data-ready='1']")
    out: dict[str, Any] = page.evaluate(
        """() => { const u = document.querySelector('.chart[data-group="loss"]').__chart.u;
        const m = u.data[3].filter(v => v != null);
        return {buckets: u.data[0].length, band_max: Math.max(...m), y_max: u.scales.y.max}; }"""
    )
    ctx.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    build = json.loads((ROOT / "api" / "static" / "build.json").read_text())
    first = sum(build["sizes"]["js"][f]["gzip_bytes"] for f in build["initial"])
    print(f"JavaScript: {build['js_gzip_bytes'] / 1024:.1f} KiB gzipped in all "
          f"({first / 1024:.1f} KiB loaded by the page; the rest with Submit)")  # fmt: skip
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as home:
        env = {"TORCHYARD_HOME": home}
        subprocess.run([sys.executable, "-m", "torchyard", "db", "upgrade"], cwd=ROOT, check=True,
                       env={**os.environ, **env}, capture_output=True)  # fmt: skip
        url = f"sqlite:///{Path(home) / 'torchyard.db'}"
        alice, job, carol = _seed(url, args.points, args.jobs)
        server, base = start_api(env)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                a, c = _logged_in(browser, base, alice), _logged_in(browser, base, carol)
                chart = [_time_page(browser, a, f"{base}/jobs/{job}", ".chart[data-group='loss'][data-ready='1']", "ty-first-chart") for _ in range(args.runs)]  # fmt: skip
                table = [_time_page(browser, c, f"{base}/", "#jobs-table tbody tr", None) for _ in range(args.runs)]  # fmt: skip
                spike = _spike_drawn(browser, a, f"{base}/jobs/{job}")
                browser.close()
        finally:
            server.terminate()
            server.wait()
    print(f"time to first chart, {args.points:,}-point job: median {statistics.median(chart) * 1000:.0f} ms "
          f"(runs: {', '.join(f'{x * 1000:.0f}' for x in chart)} ms)")  # fmt: skip
    print(f"  drawn from {spike['buckets']} buckets; band max {spike['band_max']:.3f} (the 100x spike), "
          f"y axis up to {spike['y_max']:.3f}")  # fmt: skip
    print(f"time to first table, {args.jobs:,} jobs: median {statistics.median(table) * 1000:.0f} ms "
          f"(runs: {', '.join(f'{x * 1000:.0f}' for x in table)} ms)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
