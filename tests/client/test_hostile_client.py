"""Hostile tenants, issue 25, from the command line: `torchyard token list|create|revoke`
over the API (a revoked token is refused from the next command on; the local database path
is for the first admin only, and says so), and `torchyard ui` never puts its one-time login
URL on the browser's command line, where every local user can read it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
from client_server import Run, Store

from torchyard import cli as top
from torchyard.client import ui_cmd

pytestmark = pytest.mark.hostile

ROOT = Path(__file__).resolve().parents[2]


def test_token_create_list_and_revoke_over_the_api(run: Run, store: Store) -> None:
    rc, out, err = run("token", "create", "--user", "bob", "--label", "laptop")
    assert rc == 0, err
    bob = out.strip()
    assert bob.startswith("ty_") and "\n" not in bob  # only the secret on stdout
    rc, out, _ = run("token", "list", "--json", token=bob)
    assert rc == 0 and bob not in out and '"laptop"' in out
    rc, out, _ = run("token", "list")
    assert rc == 0 and "bob" in out and "root" in out and bob not in out
    [bob_id] = _ids(run, "bob", token=bob)
    rc, _, err = run("token", "revoke", str(bob_id), token=bob)
    assert rc == 0 and "revoked" in err
    rc, _, err = run("token", "list", token=bob)
    assert rc == 1 and "401" in err  # refused from the next command on


def test_a_non_admin_cannot_make_tokens_nor_revoke_anothers(run: Run, store: Store) -> None:
    alice = store.token("alice")
    rc, _, err = run("token", "create", "--user", "mallory", "--admin", token=alice)
    assert rc == 1 and "403" in err
    root_id = _ids(run, "root")[0]
    rc, _, err = run("token", "revoke", str(root_id), token=alice)
    assert rc == 1 and "404" in err
    assert run("token", "list")[0] == 0  # the admin's token still works


def _ids(run: Run, user: str, token: str | None = None) -> list[int]:
    """The ids of `user`'s tokens, as listed with `token` (default: the admin's)."""
    out = run("token", "list", "--json", **({"token": token} if token else {}))[1]
    return [t["id"] for t in json.loads(out) if t["user"] == user]


def test_the_local_path_is_for_the_first_admin_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        top.main(["token", "create", "--local", "--help"])
    out = capsys.readouterr().out
    assert "first admin" in out and "bootstrapping" in out
    assert "first admin" in top.usage()


def test_the_local_path_makes_a_private_database(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHYARD_HOME": str(tmp_path / "home")}
    env.pop("TORCHYARD_DATABASE_URL", None)
    (tmp_path / "home").mkdir()
    up = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.umask(0o022); from torchyard.cli import main; "
         "sys.exit(main(['db', 'upgrade']) or main(['token', 'create', '--local', '--user', "
         "'admin', '--admin']))"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip().startswith("ty_")
    db = tmp_path / "home" / "torchyard.db"
    assert stat.S_IMODE(db.stat().st_mode) == 0o600, oct(db.stat().st_mode)


def test_the_one_time_login_url_is_never_on_the_browsers_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "tyl_" + "s" * 43

    class Answer:
        status_code = 201

        def json(self) -> dict[str, Any]:
            return {"path": f"/#login={secret}", "secret": secret}

    opened: list[str] = []
    monkeypatch.setattr(ui_cmd.httpx, "post", lambda *a, **kw: Answer())
    monkeypatch.setattr(ui_cmd.webbrowser, "open", lambda url: opened.append(url) or True)
    monkeypatch.setenv("BROWSER", "some-browser %s")
    assert ui_cmd.main(["--url", "http://gpu-host:8000", "--token", "ty_x"]) == 0
    assert capsys.readouterr().out.strip() == f"http://gpu-host:8000/#login={secret}"
    [arg] = opened
    assert secret not in arg, "the login secret went onto the browser's command line"
    page = Path(unquote(urlparse(arg).path))
    assert arg.startswith("file://") and page.is_file()
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert stat.S_IMODE(page.parent.stat().st_mode) == 0o700
    assert f'url=http://gpu-host:8000/#login={secret}"' in page.read_text()
