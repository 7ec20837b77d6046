"""Organising jobs from the command line, against the real API: rerun with --set, tag, note,
archive (and finding an archived job by its id prefix), delete (asking first on a terminal)."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import pytest
from client_server import SPEC, Store

from torchyard.client.sdk import Client, rerun_spec, set_at

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(run: Run, token: str) -> Run:
    """conftest's `run`, as alice (the `token` fixture's user)."""
    return functools.partial(run, token=token)


def test_rerun_sets_each_change_and_records_the_original(run: Run, ty: Client) -> None:
    old = ty.submit(SPEC | {"tags": ["base"]})
    rc, out, err = run(
        "rerun", old["id"][:8], "--set", "optimizer.lr=0.01", "--set", "epochs=3",
        "--set", "name=again", "--set", "model.hidden=[32, 16]",
    )  # fmt: skip
    assert rc == 0, err
    new_id = out.strip()
    assert len(new_id) == 32 and new_id != old["id"]
    new = ty.job(new_id)
    assert new["rerun_of"] == old["id"] and new["name"] == "again"
    assert new["spec"]["optimizer"]["lr"] == 0.01 and new["spec"]["epochs"] == 3
    assert new["spec"]["model"]["hidden"] == [32, 16]
    assert new["tags"] == ["base"]  # kept beside the spec, carried over
    unchanged = {k: v for k, v in old["spec"].items() if k not in ("optimizer", "epochs", "name", "model")}  # fmt: skip
    assert {k: new["spec"][k] for k in unchanged} == unchanged
    # Without changes, the same spec again.
    rc, out, _ = run("rerun", old["id"])
    assert rc == 0 and ty.job(out.strip())["spec"] == old["spec"]


def test_rerun_reports_bad_changes(run: Run, ty: Client) -> None:
    old = ty.submit(SPEC)
    rc, out, err = run("rerun", old["id"], "--set", "optimizer.lr=-1", "--set", "colour=red")
    assert rc == 2 and out == ""
    assert "optimizer.lr" in err and "colour" in err  # the server names each field
    assert run("rerun", old["id"], "--set", "no-equals-sign")[0] == 2
    rc, _, err = run("rerun", old["id"], "--set", "model.hidden.7=1")
    assert rc == 2 and "model.hidden" in err
    assert len(ty.jobs()["items"]) == 1  # nothing was submitted


def test_set_at_follows_dotted_paths() -> None:
    spec: dict = {"optimizer": {"name": "sgd"}, "model": {"hidden": [1, 2]}, "epochs": 1}
    set_at(spec, "optimizer.lr", 0.1)
    set_at(spec, "model.hidden.1", 5)
    set_at(spec, "model.hidden.2", 6)  # the length appends
    set_at(spec, "data.args.root", "x")  # missing mappings are made
    set_at(spec, "epochs.deep", 2)  # through a scalar: the server says what is wrong
    assert spec == {"optimizer": {"name": "sgd", "lr": 0.1}, "model": {"hidden": [1, 5, 6]},
                    "epochs": {"deep": 2}, "data": {"args": {"root": "x"}}}  # fmt: skip
    for bad in ("model.hidden.9", "a..b", "model.hidden.x"):
        with pytest.raises(ValueError):
            set_at(spec, bad, 0)
    job = {"spec": {"a": 1}, "tags": ["t"], "project": "~alice"}
    assert rerun_spec(job, {}) == {"a": 1, "tags": ["t"]}  # a personal project is not kept
    assert rerun_spec(job | {"project": "vision"}, {})["project"] == "vision"


def test_tag_note_archive_and_list_by_tag(run: Run, ty: Client) -> None:
    job = ty.submit(SPEC)["id"]
    other = ty.submit(SPEC)["id"]
    assert run("tag", job[:6], "--add", "a", "--add", "b")[1] == "tags: a, b\n"
    assert run("tag", job, "--remove", "a", "--add", "c")[1] == "tags: b, c\n"
    assert run("tag", job)[1] == "tags: b, c\n"
    assert run("tag", other)[1] == "no tags\n"
    rc, out, _ = run("list", "--tag", "c")
    assert rc == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [job[:12]]
    rc, _, err = run("tag", job, "--add", "no spaces")
    assert rc == 2 and "tags" in err and ty.job(job)["tags"] == ["b", "c"]

    assert run("note", job, "tried a smaller lr") == (0, "notes saved\n", "")
    assert run("note", job) == (0, "tried a smaller lr\n", "")
    rc, out, _ = run("status", job)
    assert "tried a smaller lr" in out and "b, c" in out
    assert run("note", job, "")[1] == "notes cleared\n" and ty.job(job)["notes"] is None

    assert run("archive", job[:8]) == (0, f"archived {job}\n", "")
    listed = run("list")[1]
    assert job[:12] not in listed and other[:12] in listed
    assert job[:12] in run("list", "--archived")[1]
    assert "archived" in run("status", job[:8])[1]  # a prefix finds an archived job too
    assert run("archive", job[:8], "--undo") == (0, f"unarchived {job}\n", "")
    assert job[:12] in run("list")[1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_delete_an_ended_job_asking_first_on_a_terminal(
    run: Run, ty: Client, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = ty.submit(SPEC)["id"]
    rc, _, err = run("delete", job, "--yes")
    assert rc == 1 and "cancel it first" in err and ty.job(job)["state"] == "queued"
    store.run(job)  # a whole life: metrics, a checkpoint file, succeeded
    monkeypatch.setattr("sys.stdin", _Terminal("n\n"))
    rc, out, err = run("delete", job[:8])
    assert rc == 1 and "for good? [y/N]" in out and "nothing deleted" in err
    assert ty.job(job)["state"] == "succeeded"
    monkeypatch.setattr("sys.stdin", _Terminal("y\n"))
    rc, out, _ = run("delete", job[:8])
    assert rc == 0 and out.endswith(f"deleted {job}\n")
    assert run("status", job)[0] == 1  # not found
    assert store.state(job) is None


def test_delete_without_yes_refuses_when_stdin_is_no_terminal(
    run: Run, ty: Client, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = ty.submit(SPEC)["id"]
    store.run(job)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # piped: nobody to ask
    rc, out, err = run("delete", job[:8])
    assert (rc, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("error: ") and "not a terminal" in err and "--yes" in err
    assert ty.job(job)["state"] == "succeeded"  # still there
    assert run("delete", job[:8], "--yes")[:2] == (0, f"deleted {job}\n")


def test_list_archived_marks_the_archived_rows(run: Run, ty: Client) -> None:
    archived, live = ty.submit(SPEC)["id"], ty.submit(SPEC)["id"]
    run("archive", archived)
    rc, out, err = run("list", "--archived")
    assert rc == 0, err
    head, *rows = [line.split() for line in out.splitlines()]
    assert head[-1] == "ARCHIVED"
    assert {r[0]: r[-1] for r in rows} == {archived[:12]: "yes", live[:12]: "-"}
    assert "ARCHIVED" not in run("list")[1]  # only archived rows could say yes
