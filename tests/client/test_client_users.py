"""`torchyard user set` and `torchyard user link` against the real API (a TestClient of
create_app on SQLite): permissions given and taken back for every token of the user, and the
refusals as one line."""

from __future__ import annotations

import json

from client_server import Run
from fastapi.testclient import TestClient

from torchyard.api.app import create_app
from torchyard.client.cli import main
from torchyard.settings import Settings


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.strip().splitlines())


def test_user_set_gives_and_takes_back_at_once(run: Run, token: str) -> None:
    assert json.loads(run("token", "list", "--json", token=token)[1])  # alice's token, cached
    rc, out, err = run("user", "set", "alice", "--admin", "--code")
    assert rc == 0, err
    assert _fields(out) == {"user": "alice", "admin": "yes", "can_run_code": "yes"}
    rc, out, _ = run("token", "list", "--json", token=token)
    assert {t["user"] for t in json.loads(out)} == {"alice", "root"}  # an admin's list
    rc, out, _ = run("user", "set", "alice", "--no-admin", "--json")
    assert rc == 0 and json.loads(out) == {"user": "alice", "admin": False, "can_run_code": True}
    rc, out, _ = run("token", "list", "--json", token=token)
    assert {t["user"] for t in json.loads(out)} == {"alice"}
    rc, _, err = run("user", "set", "root", "--admin", token=token)  # no longer an admin
    assert rc == 1 and "only admins" in err and err.count("\n") == 1


def test_user_set_refusals(run: Run) -> None:
    rc, out, err = run("user", "set", "root")
    assert rc == 2 and out == "" and "nothing to set" in err
    rc, _, err = run("user", "set", "me", "--no-admin")
    assert rc == 1 and "last admin" in err and err.count("\n") == 1
    rc, _, err = run("user", "set", "nobody", "--code")
    assert rc == 1 and "'nobody' not found" in err
    rc, out, _ = run("user", "set", "root", "--no-admin", "--admin", "--json")  # the last wins
    assert rc == 0 and json.loads(out)["admin"] is True


def test_user_link(run: Run, settings: Settings, root: str, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, _, err = run("user", "link", "root", "sub-root")
    assert rc == 1 and "single sign-on is not configured" in err
    # The link is stored without asking the provider: its address need not answer.
    sso = settings.model_copy(update={"oidc_issuer": "http://127.0.0.1:9", "oidc_client_id": "ty",
                                      "oidc_client_secret": "s" * 32})  # fmt: skip
    with TestClient(create_app(sso)) as http:
        assert main(["user", "link", "root", "sub-root", "--token", root], http=http) == 0
        assert "'sub-root' at http://127.0.0.1:9 now signs in as root" in capsys.readouterr().err
