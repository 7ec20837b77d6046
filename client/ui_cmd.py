"""`torchyard ui`: print a URL that opens the dashboard logged in, and open it.

The URL carries a one-time secret (POST /v1/ui/login-links, made with this CLI's token) in
its fragment: browsers never send a fragment to the server, the page takes it out of the
address bar at once and exchanges it for a session cookie, and the secret is good for one
exchange within five minutes. The token itself never leaves this process.

It opens the URL with the browser `BROWSER` names (Python's `webbrowser` rules), or the
desktop's default where there is a display; elsewhere (an SSH session) it only prints it.
The browser is never given the URL itself on its command line, where every local user can
read it (/proc/<pid>/cmdline, `ps`) and log in first: it gets a small page written for this
one login (mode 0600, in a fresh folder of mode 0700 under the temp directory), which sends
it on to the URL at once. Only this user can read that page; the secret in it is good once,
for five minutes. The same way Jupyter opens its token URL.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import tempfile
import webbrowser
from collections.abc import Mapping
from pathlib import Path

import httpx

from torchyard.client.config import LOOKUP_ORDER, resolve

HELP = "print (and open) a URL that lands in the dashboard logged in; good once, for 5 minutes"


def _can_open(env: Mapping[str, str]) -> bool:
    """A browser to open: BROWSER set, or a desktop (not a console browser on a server)."""
    if env.get("BROWSER"):
        return True
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def redirect_page(url: str) -> Path:
    """A page that sends the browser on to `url`, readable by this user only: a new file
    (mode 0600) in a new folder (mode 0700). Its own path tells nothing."""
    folder = Path(tempfile.mkdtemp(prefix="torchyard-ui-"))
    page = folder / "login.html"
    target = html.escape(url, quote=True)
    body = (
        '<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
        f'<meta http-equiv="refresh" content="0;url={target}"><title>torchyard</title>'
        f'<p><a href="{target}">Open the torchyard dashboard</a></p>\n'
    )
    fd = os.open(page, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a fresh folder: no link
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body)
    return page


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchyard ui", description=HELP, epilog=LOOKUP_ORDER)
    p.add_argument("--url", help="the server (default: as every command finds it)")
    p.add_argument("--token", help="the API token (default: as every command finds it)")
    p.add_argument("--no-open", action="store_true", help="print the URL only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    conn = resolve(args.url, args.token)
    if not conn.token:
        print(f"torchyard ui: {conn.token_hint()}", file=sys.stderr)
        return 1
    try:
        r = httpx.post(
            f"{conn.url}/v1/ui/login-links",
            headers={"Authorization": f"Bearer {conn.token}"},
            timeout=30,
        )
    except httpx.HTTPError as e:
        print(f"torchyard ui: cannot reach {conn.url} ({e}); {conn.unreachable_hint()}", file=sys.stderr)  # fmt: skip
        return 1
    if r.status_code != 201:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        hint = f"; {conn.token_hint()}" if r.status_code == 401 else ""
        print(f"torchyard ui: {r.status_code} {message}{hint}", file=sys.stderr)
        return 1
    url = conn.url + r.json()["path"]
    print(url)
    print("(logs in once, within 5 minutes; run `torchyard ui` again for another)", file=sys.stderr)
    if not args.no_open and _can_open(os.environ):
        try:
            opened = webbrowser.open(redirect_page(url).as_uri())
        except (webbrowser.Error, OSError):
            opened = False
        if not opened:
            print("torchyard ui: no browser to open: open the URL above", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
