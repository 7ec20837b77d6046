"""`torchyard quota set|show --project NAME` and the SDK's project_quota / set_project_quota,
against the real API (a TestClient of create_app on SQLite)."""

from __future__ import annotations

import json

import pytest
from client_server import SPEC, Run
from fastapi.testclient import TestClient

from torchyard.client.errors import APIError, NotFound, Unauthorized
from torchyard.client.sdk import Client


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.strip().splitlines())


@pytest.fixture
def lab(ty: Client) -> str:
    """Project `lab`, made (and owned) by alice."""
    return str(ty.create_project("lab")["name"])


def test_quota_set_and_show_a_project(run: Run, token: str, lab: str) -> None:
    rc, out, err = run("quota", "set", "--project", lab, "--max-workers", "4",
                       "--max-queued", "20", "--share", "2")  # fmt: skip
    assert rc == 0, err
    want = {"project": "lab", "max_workers": "4", "max_queued": "20", "share": "2"}
    assert _fields(out) == want
    assert _fields(run("quota", "show", "--project", lab)[1]) == want
    # a member reads it too (alice owns lab)
    assert _fields(run("quota", "show", "--project", lab, token=token)[1]) == want
    rc, out, _ = run("quota", "set", "--project", lab, "--max-workers", "none", "--json")
    assert rc == 0 and json.loads(out) == {"project": "lab", "max_workers": None,
                                           "max_queued": 20, "share": 2.0}  # fmt: skip
    assert _fields(run("quota", "show", "--project", lab)[1])["max_workers"] == "no limit"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--project", "lab", "--max-priority", "5"], "a project has no --max-priority"),
        (["--project", "lab"], "nothing to set"),
        (["alice", "--project", "lab", "--share", "2"], "give a USER or --project NAME"),
        (["--share", "2"], "give a USER or --project NAME"),
        (["--project", "lab", "--share", "0"], "must be a number > 0"),
    ],
)
def test_quota_set_project_bad_input_is_exit_2(
    run: Run, lab: str, argv: list[str], says: str
) -> None:
    rc, out, err = run("quota", "set", *argv)
    assert rc == 2 and out == "" and says in err
    assert json.loads(run("quota", "show", "--project", lab, "--json")[1])["share"] == 1.0


def test_quota_show_wants_one_of_user_and_project(run: Run, lab: str) -> None:
    rc, out, err = run("quota", "show", "alice", "--project", lab)
    assert rc == 2 and out == "" and "not both" in err


def test_a_non_admin_may_not_set_it(run: Run, token: str, lab: str) -> None:
    rc, _, err = run("quota", "set", "--project", lab, "--share", "9", token=token)
    assert rc != 0 and "admin" in err


def test_sdk_project_quota(http: TestClient, ty: Client, root: str, lab: str) -> None:
    admin = Client(token=root, http=TestClient(http.app))
    assert admin.set_project_quota(lab, max_queued=1, share=0.5) == {
        "project": "lab", "max_workers": None, "max_queued": 1, "share": 0.5,
    }  # fmt: skip
    assert ty.project_quota(lab) == admin.project_quota(lab)
    with pytest.raises(Unauthorized) as e:
        ty.set_project_quota(lab, share=9)
    assert e.value.status == 403
    with pytest.raises(NotFound):
        ty.project_quota("nowhere")
    ty.submit(SPEC | {"project": "lab"})
    with pytest.raises(APIError) as refused:
        ty.submit(SPEC | {"project": "lab"})
    assert refused.value.status == 429 and refused.value.code == "quota_exceeded"
    assert refused.value.details == [{"field": "max_queued", "limit": 1, "project": "lab"}]
    assert "project lab already has 1 queued jobs" in str(refused.value)
    ty.submit(SPEC)  # alice's personal project is not lab
