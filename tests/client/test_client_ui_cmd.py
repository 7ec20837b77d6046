"""`torchyard ui` without a server: when it opens a browser, and what it says without a
token. (Its URL logging a real browser in is tested in tests/web.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchyard.client import ui_cmd


@pytest.mark.parametrize(
    ("env", "platform", "opens"),
    [
        ({"BROWSER": "firefox"}, "linux", True),
        ({"DISPLAY": ":0"}, "linux", True),
        ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", True),
        ({}, "linux", False),  # an SSH session: never a console browser over the terminal
        ({}, "darwin", True),
    ],
)
def test_opens_only_where_a_browser_is(
    env: dict[str, str], platform: str, opens: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ui_cmd.sys, "platform", platform)
    assert ui_cmd._can_open(env) is opens


def test_no_token_is_an_error_naming_where_it_looked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in ("TORCHYARD_URL", "TORCHYARD_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHYARD_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setenv("TORCHYARD_HOME", str(tmp_path / "home"))
    assert ui_cmd.main(["--url", "http://127.0.0.1:9", "--no-open"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torchyard ui: no token for http://127.0.0.1:9")


def test_unreachable_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHYARD_CONFIG", str(tmp_path / "none.json"))
    rc = ui_cmd.main(["--url", "http://127.0.0.1:9", "--token", "ty_x", "--no-open"])
    assert rc == 1 and "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
