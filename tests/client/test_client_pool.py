"""`torchyard quota` and `torchyard queue`, and their SDK calls, against the real API (a
TestClient of create_app on SQLite)."""

from __future__ import annotations

import json

import pytest
from client_server import SPEC, Run, Store
from fastapi.testclient import TestClient

from torchyard.client.errors import APIError, Unauthorized
from torchyard.client.sdk import Client


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.strip().splitlines())


def test_quota_set_and_show(run: Run, token: str) -> None:
    rc, out, err = run("quota", "set", "alice", "--max-workers", "4", "--max-queued", "20",
                       "--share", "2")  # fmt: skip
    assert rc == 0, err
    want = {"user": "alice", "max_workers": "4", "max_queued": "20", "share": "2",
            "max_priority": "0"}  # fmt: skip
    assert _fields(out) == want
    assert _fields(run("quota", "show", "alice")[1]) == want
    # without USER: the caller's own (alice's token)
    assert _fields(run("quota", "show", token=token)[1]) == want
    rc, out, _ = run("quota", "show", "alice", "--json")
    assert rc == 0 and json.loads(out) == {"user": "alice", "max_workers": 4, "max_queued": 20,
                                           "share": 2.0, "max_priority": 0}  # fmt: skip


def test_quota_set_none_removes_a_limit_and_keeps_the_rest(run: Run, token: str) -> None:
    run("quota", "set", "alice", "--max-workers", "4", "--max-queued", "20", "--share", "2")
    rc, out, _ = run("quota", "set", "alice", "--max-workers", "none", "--share", "none", "--json")
    assert rc == 0
    assert json.loads(out) == {"user": "alice", "max_workers": None, "max_queued": 20, "share": 1.0,
                               "max_priority": 0}  # fmt: skip
    assert _fields(run("quota", "show", token=token)[1])["max_workers"] == "no limit"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-workers", "-1"], "must be >= 0"),
        (["--max-queued", "lots"], "not a whole number"),
        (["--share", "0"], "must be a number > 0"),
        (["--share", "nan"], "must be a number > 0"),
        (["--max-priority", "1001"], "must be from -1000 to 1000"),
        (["--max-priority", "high"], "not a whole number or `default`"),
        ([], "nothing to set"),
    ],
)
def test_quota_set_bad_input_is_exit_2(run: Run, token: str, argv: list[str], says: str) -> None:
    rc, out, err = run("quota", "set", "alice", *argv)
    assert rc == 2 and out == "" and says in err
    assert json.loads(run("quota", "show", "alice", "--json")[1])["max_workers"] is None


def test_quota_set_max_priority_and_back_to_the_default(run: Run, token: str) -> None:
    rc, out, err = run("quota", "set", "alice", "--max-priority", "50", "--json")
    assert rc == 0, err
    assert json.loads(out)["max_priority"] == 50
    assert _fields(run("quota", "show", token=token)[1])["max_priority"] == "50"
    rc, out, _ = run("quota", "set", "alice", "--max-priority", "default", "--json")
    assert rc == 0 and json.loads(out)["max_priority"] == 0


def test_quota_refusals_are_one_line(run: Run, token: str) -> None:
    rc, _, err = run("quota", "set", "alice", "--share", "3", token=token)
    assert rc == 1 and err == "error: 403 only admins may do this\n"
    rc, _, err = run("quota", "show", "root", token=token)
    assert rc == 1 and err.startswith("error: 403 ")
    rc, _, err = run("quota", "show", "nobody")
    assert rc == 1 and err == "error: 404 user 'nobody' not found\n"


def test_submit_over_max_queued_is_refused_with_the_limit_named(
    run: Run, token: str, tmp_path, store: Store
) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    run("quota", "set", "alice", "--max-queued", "1")
    assert run("submit", str(spec), token=token)[0] == 0
    rc, out, err = run("submit", str(spec), token=token)
    assert rc == 1 and out == ""
    assert err == (
        "error: 429 alice already has 1 queued jobs, the quota's max_queued is 1; "
        "wait for some to start or cancel some\n"
    )


def _queue(store: Store) -> dict[str, str]:
    """alice's two jobs and bob's one, bob's at priority 3."""
    return {
        "a1": store.job("alice", spec=SPEC | {"name": "a1"}),
        "b1": store.job("bob", spec=SPEC | {"name": "b1", "priority": 3}),
        "a2": store.job("alice", spec=SPEC | {"name": "a2"}, pending_reason="waiting for 1 worker"),
    }


def test_queue_table_for_an_admin(run: Run, store: Store) -> None:
    ids = _queue(store)
    run("quota", "set", "bob", "--max-workers", "2", "--share", "2")
    rc, out, err = run("queue")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "3 queued jobs from 2 users, 0 of them yours"
    assert lines[2].split() == ["#", "ID", "NAME", "OWNER", "PRIORITY", "WORKERS", "PENDING",
                                "REASON"]  # fmt: skip
    rows = [ln.split(None, 6) for ln in lines[3:6]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("1", ids["b1"][:12], "b1", "bob"),
        ("2", ids["a1"][:12], "a1", "alice"),
        ("3", ids["a2"][:12], "a2", "alice"),
    ]
    assert rows[0][4:] == ["3", "1", "-"] and rows[2][6] == "waiting for 1 worker"
    assert lines[7].startswith("usage (worker-hours, half-life 1 day;")
    assert lines[8].split() == ["USER", "WORKER-H", "SHARE", "MAX", "WORKERS", "MAX", "QUEUED"]
    assert lines[9].split() == ["alice", "0.00", "1", "no", "limit", "no", "limit"]
    assert lines[10].split() == ["bob", "0.00", "2", "2", "no", "limit"]


def test_queue_for_a_user_shows_their_jobs_only(run: Run, token: str, store: Store) -> None:
    ids = _queue(store)
    rc, out, _ = run("queue", token=token)
    assert rc == 0
    assert out.splitlines()[0] == "3 queued jobs from 2 users, 2 of them yours"
    assert ids["a1"][:12] in out and ids["a2"][:12] in out and ids["b1"][:12] not in out
    assert "bob" not in out
    rc, out, _ = run("queue", "--json", "-n", "1", token=token)
    body = json.loads(out)
    assert [(i["id"], i["position"]) for i in body["items"]] == [(ids["a1"], 2)]
    assert list(body["usage"]) == ["alice"]
    rc, out, _ = run("queue", "-n", "1", token=token)
    assert out.splitlines()[0].endswith("(the first 1 shown; --limit for more)")


def test_an_empty_queue(run: Run) -> None:
    rc, out, _ = run("queue")
    assert rc == 0 and out == "0 queued jobs from 0 users, 0 of them yours\n"


def test_sdk_quota_and_queue(http: TestClient, ty: Client, root: str, store: Store) -> None:
    # its own connection: a Client sets its token on the httpx.Client it is given
    admin = Client(token=root, http=TestClient(http.app))
    assert admin.set_quota("alice", max_queued=2, share=0.5) == {
        "user": "alice", "max_workers": None, "max_queued": 2, "share": 0.5, "max_priority": 0,
    }  # fmt: skip
    assert admin.set_quota("alice", max_queued=None)["max_queued"] is None
    assert ty.get_quota() == admin.get_quota("alice")
    with pytest.raises(Unauthorized) as e:
        ty.set_quota("alice", share=9)
    assert e.value.status == 403 and e.value.code == "forbidden"
    admin.set_quota("alice", max_queued=0)
    with pytest.raises(APIError) as refused:
        ty.submit(SPEC)
    assert refused.value.status == 429 and refused.value.code == "quota_exceeded"
    assert refused.value.details == [{"field": "max_queued", "limit": 0}]
    jid = store.job("alice")
    q = ty.queue()
    assert [i["id"] for i in q["items"]] == [jid] and q["counts"]["mine"] == 1


def test_one_of_a_count_is_singular(run: Run, store: Store) -> None:
    job = store.job("alice", spec=SPEC | {"name": "a1"})
    rc, out, err = run("queue")
    assert rc == 0, err
    assert out.splitlines()[0] == "1 queued job from 1 user, 0 of them yours"
    assert job[:12] in out
