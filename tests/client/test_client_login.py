"""Finding the server from any directory: the lookup order, the per-user login file
(`torchyard login`, and `torchyard up` writing it too), and messages that say where the URL
and the token were looked for."""

from __future__ import annotations

import io
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from torchyard.client import config, errors
from torchyard.client.cli import main
from torchyard.client.config import LOOKUP_ORDER, resolve
from torchyard.up import save_login

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(http: TestClient, capsys: pytest.CaptureFixture[str]) -> Run:
    """run(*argv) -> (exit code, stdout, stderr): the CLI against the app, no token given."""

    def _run(*argv: str) -> tuple[int, str, str]:
        rc = main(list(argv), http=http)
        out, err = capsys.readouterr()
        return rc, out, err

    return _run


def test_lookup_order_and_a_saved_token_stays_with_its_url(tmp_path: Path) -> None:
    home, cfg = tmp_path / "home", tmp_path / "cfg.json"
    env = {"TORCHYARD_HOME": str(home), "TORCHYARD_CONFIG": str(cfg)}
    c = resolve(env=env)
    assert (c.url, c.token, c.url_from) == ("http://127.0.0.1:8000", None, "the default")
    home.mkdir()
    (home / "url").write_text("http://up.local:9000\n")
    (home / "admin-token").write_text("ty_home\n")
    c = resolve(env=env)
    assert (c.url, c.token, c.token_from) == (
        "http://up.local:9000",
        "ty_home",
        str(home / "admin-token"),
    )
    config.save("http://login:1/", "ty_login", saved_by="login", env=env)
    c = resolve(env=env)  # the login file comes before the home's files
    assert (c.url, c.token, c.token_from) == ("http://login:1", "ty_login", str(cfg))
    c = resolve(env=env | {"TORCHYARD_URL": "http://up.local:9000"})
    assert (c.url, c.token) == ("http://up.local:9000", "ty_home")  # the token of that URL
    c = resolve(env=env | {"TORCHYARD_URL": "http://elsewhere:2"})
    assert c.token is None and c.url_from == "TORCHYARD_URL"  # no saved token goes there
    assert f"{cfg} (its token is for http://login:1)" in c.token_hint()
    c = resolve(env=env | {"TORCHYARD_URL": "http://elsewhere:2", "TORCHYARD_TOKEN": "ty_env"})
    assert (c.token, c.token_from) == ("ty_env", "TORCHYARD_TOKEN")
    c = resolve("http://flag:3", "ty_flag", env=env | {"TORCHYARD_TOKEN": "ty_env"})
    assert (c.url, c.token, c.url_from, c.token_from) == (
        "http://flag:3",
        "ty_flag",
        "--url",
        "--token",
    )


def test_the_login_file_is_created_private_and_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "torchyard" / "config.json"
    env = {"TORCHYARD_CONFIG": str(path)}
    old = os.umask(0)  # even with nothing masked, the token is never readable by others
    try:
        config.save("http://a:1", "ty_a", saved_by="login", env=env)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        path.chmod(0o644)  # a file someone loosened: the rename puts a 0600 one in its place
        config.save("http://b:2", "ty_b", saved_by="up", env=env)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"url": "http://b:2", "token": "ty_b", "saved_by": "up"}
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temporary left
    assert config.load(env) == config.Saved("http://b:2", "ty_b", "up", path)


def test_the_default_path_follows_xdg_and_home() -> None:
    assert config.config_path({"HOME": "/h"}) == Path("/h/.config/torchyard/config.json")
    assert config.config_path({"HOME": "/h", "XDG_CONFIG_HOME": "/x"}) == Path(
        "/x/torchyard/config.json"
    )


def test_a_broken_login_file_is_exit_2_naming_it(
    _own_login_file: Path, run: Run, token: str
) -> None:
    _own_login_file.parent.mkdir(parents=True)
    _own_login_file.write_text("{not json")
    with pytest.raises(errors.ConfigError, match="not a torchyard login file"):
        config.load()
    rc, _, err = run("list")
    assert rc == 2 and str(_own_login_file) in err and "torchyard login" in err
    rc, _, err = run("list", "--url", "http://testserver", "--token", token)
    assert rc == 0, err  # a command that needs nothing from it is not stopped by it


def test_an_empty_token_variable_is_an_error_never_the_saved_admin_token(
    tmp_path: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "url").write_text("http://testserver\n")
    (home / "admin-token").write_text("ty_admin\n")
    env = {"TORCHYARD_HOME": str(home), "TORCHYARD_CONFIG": str(tmp_path / "cfg.json")}
    for empty in ("", "  "):
        with pytest.raises(errors.ConfigError, match="TORCHYARD_TOKEN is set but empty"):
            resolve(env=env | {"TORCHYARD_TOKEN": empty})
    assert resolve("http://x", "ty_flag", env=env | {"TORCHYARD_TOKEN": ""}).token == "ty_flag"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHYARD_TOKEN", "")
    rc, _, err = run("list")
    assert rc == 2 and "unset TORCHYARD_TOKEN" in err


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused")


def test_cannot_reach_says_where_the_url_was_looked_for(
    _own_login_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = httpx.MockTransport(_refused)
    assert main(["list"], transport=refused) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the torchyard API at http://127.0.0.1:8000")
    assert err.count("\n") == 1
    for place in ("--url", "TORCHYARD_URL", f"{_own_login_file} (absent)", "url (absent)"):
        assert place in err, place
    assert "`torchyard up`" in err and "`torchyard login URL --token T`" in err
    monkeypatch.setenv("TORCHYARD_URL", "http://gpu-box:8000")
    assert main(["list"], transport=refused) == 1
    err = capsys.readouterr().err
    assert "http://gpu-box:8000" in err and "the URL came from TORCHYARD_URL" in err


def test_401_without_a_token_names_the_options_not_the_header(
    _own_login_file: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, _, err = run("list")
    assert rc == 1 and err.startswith("error: 401 no API token") and err.count("\n") == 1
    assert "Authorization" not in err
    for place in ("--token", "TORCHYARD_TOKEN", f"{_own_login_file} (absent)", "admin-token"):
        assert place in err, place
    monkeypatch.setenv("TORCHYARD_TOKEN", "ty_wrong")
    rc, _, err = run("list")
    assert rc == 1 and err.startswith("error: 401 ") and "came from TORCHYARD_TOKEN" in err


def test_login_checks_the_token_then_saves_it_for_every_command(
    _own_login_file: Path, run: Run, token: str
) -> None:
    rc, out, err = run("login", "http://testserver", "--token", token)
    assert rc == 0, err
    assert "logged in to http://testserver as alice" in out and str(_own_login_file) in out
    assert stat.S_IMODE(_own_login_file.stat().st_mode) == 0o600
    saved = json.loads(_own_login_file.read_text())
    assert saved == {"url": "http://testserver", "token": token, "saved_by": "login"}
    rc, out, err = run("list")  # no --token, no TORCHYARD_TOKEN: the login file's
    assert rc == 0 and out.strip() == "no jobs", err


def test_login_with_a_wrong_token_or_none_saves_nothing(
    _own_login_file: Path, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, _, err = run("login", "http://testserver", "--token", "ty_wrong")
    assert rc == 1 and err.startswith("error: 401 ") and "nothing was saved" in err
    monkeypatch.setattr("sys.stdin", io.StringIO())  # not a terminal: nobody to ask
    rc, _, err = run("login", "http://testserver")
    assert rc == 2 and "--token" in err
    assert not _own_login_file.exists()


@pytest.mark.parametrize("command", [["list"], ["submit"], ["quota", "set"], ["sweep", "list"]])
def test_help_gives_the_lookup_order_of_the_readme(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert LOOKUP_ORDER in help_text
    the_cli = README.split("## The CLI", 1)[1].split("\n## ", 1)[0]
    assert LOOKUP_ORDER in " ".join(the_cli.replace("`", "").split())


def test_up_saves_its_login_but_keeps_a_login_to_another_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"TORCHYARD_CONFIG": str(tmp_path / "config.json")}
    save_login("http://127.0.0.1:8000", "ty_up1", env)
    assert config.load(env) == config.Saved(
        "http://127.0.0.1:8000", "ty_up1", "up", tmp_path / "config.json"
    )
    assert "saved http://127.0.0.1:8000" in capsys.readouterr().out
    save_login("http://127.0.0.1:8001", "ty_up2", env)  # another `up`: replaces the first
    assert config.load(env).token == "ty_up2"  # type: ignore[union-attr]
    config.save("https://team:443", "ty_alice", saved_by="login", env=env)
    save_login("http://127.0.0.1:8000", "ty_up3", env)
    out = " ".join(capsys.readouterr().out.split())
    assert config.load(env).token == "ty_alice"  # type: ignore[union-attr]
    assert "kept your login to https://team:443" in out
    assert re.search(r"torchyard login http://127\.0\.0\.1:8000 --token", out)
    config.save("http://127.0.0.1:8000", "ty_bob", saved_by="login", env=env)
    save_login("http://127.0.0.1:8000", "ty_up4", env)  # a login to this very server: kept
    assert config.load(env).token == "ty_bob" and capsys.readouterr().out == ""  # type: ignore[union-attr]
