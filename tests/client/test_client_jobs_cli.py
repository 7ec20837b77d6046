"""Job commands a user meets in the first hour, against the real API: `list` with several
states and pages, id prefixes (in the SDK too), `cancel` of an ended job, `logs --tail`,
Ctrl-C while following, the first plain progress line, and 429 as its own error."""

from __future__ import annotations

import functools
import io
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from client_server import SPEC, STEPS, Store

from torchyard.client import errors
from torchyard.client.cli import follow_job
from torchyard.client.sdk import Client, _last_lines
from torchyard.store.paths import LOG_FILE, job_dir

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(run: Run, token: str) -> Run:
    """conftest's `run`, as alice (the `token` fixture's user)."""
    return functools.partial(run, token=token)


def _ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:]]


def test_list_takes_several_states_and_pages_on(run: Run, store: Store) -> None:
    failed = store.job(state="failed")
    cancelled = store.job(state="cancelled")
    queued = store.job()
    rc, out, err = run("list", "--state", "failed", "--state", "cancelled")
    assert rc == 0 and set(_ids(out)) == {failed[:12], cancelled[:12]} and err == ""
    rc, out, err = run("list", "-n", "2")
    assert rc == 0 and _ids(out) == [queued[:12], cancelled[:12]]
    assert err.startswith("… more jobs: torchyard list -n 2 --cursor ") and "--all" in err
    cursor = err.split("--cursor ")[1].split()[0]
    rc, out, err = run("list", "-n", "2", "--cursor", cursor)
    assert _ids(out) == [failed[:12]] and err == ""  # the last page says nothing more
    rc, out, err = run("list", "--all", "-n", "1")
    assert len(_ids(out)) == 3 and err == ""
    rc, out, err = run("list", "--state", "succeeded")
    assert out == "no jobs in state succeeded\n"
    assert run("list", "-n", "0")[0] == 2


def _sharing_a_first_digit(store: Store) -> tuple[str, str]:
    """Two jobs whose ids begin alike (at most 17 jobs make sure of it)."""
    seen: dict[str, str] = {}
    while True:
        job = store.job()
        if job[0] in seen:
            return seen[job[0]], job
        seen[job[0]] = job


def test_an_ambiguous_prefix_lists_the_jobs_and_exits_2(run: Run, store: Store, ty: Client) -> None:
    a, b = _sharing_a_first_digit(store)
    rc, _, err = run("status", a[0])
    assert rc == 2 and err.startswith(f"error: {a[0]} matches ") and err.count("\n") == 1
    assert a[:12] in err and b[:12] in err and "queued" in err and "give more of the id" in err
    with pytest.raises(errors.AmbiguousId) as e:
        ty.job(a[0])
    assert set(e.value.matches) >= {a, b}
    assert ty.job(a[:20])["id"] == a  # the SDK takes a unique prefix as the CLI does
    assert ty.metrics(b[:20]) == {}
    with pytest.raises(errors.NotFound, match="no job id starts with"):
        ty.job("f" * 31 if not a.startswith("f" * 31) else "0" * 31)


def test_cancel_of_an_ended_job_says_already_and_exits_0(
    run: Run, store: Store, ty: Client
) -> None:
    done = store.job(state="succeeded")
    rc, out, err = run("cancel", done[:8])
    assert rc == 0 and out == f"job {done} already succeeded: nothing to cancel\n" and err == ""
    with pytest.raises(errors.Conflict, match="already succeeded"):
        ty.cancel(done)
    queued = store.job()
    rc, out, _ = run("cancel", queued)
    assert (rc, out) == (0, f"job {queued} cancelled\n")
    # Cancelled before: the same words as any other ended job, not "cancel requested".
    rc, out, _ = run("cancel", queued)
    assert (rc, out) == (0, f"job {queued} already cancelled: nothing to cancel\n")


def test_429_is_quota_exceeded(
    run: Run, ty: Client, store: Store, http: object, tmp_path: Path
) -> None:
    admin = Client(token=store.token("root", admin=True), http=http)  # type: ignore[arg-type]
    admin.set_quota("alice", max_queued=0)
    ty = Client(token=ty.token, http=http)  # type: ignore[arg-type]  # (they share `http`)
    with pytest.raises(errors.QuotaExceeded) as e:
        ty.submit(SPEC)
    assert e.value.status == 429 and not e.value.is_user_error
    spec = tmp_path / "s.json"
    spec.write_text('{"model": {"name": "mlp"}, "data": {"name": "synthetic"}, '
                    '"optimizer": {"name": "sgd"}}')  # fmt: skip
    rc, _, err = run("submit", str(spec))
    assert rc == 1 and err.startswith("error: 429 ")


def _log(store: Store, job_id: str, text: str) -> None:
    path = job_dir(store.settings.storage, job_id) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_logs_tail_shows_the_last_lines(run: Run, store: Store, ty: Client) -> None:
    job_id = store.job(state="succeeded")
    lines = [f"line {i}" for i in range(20_000)]  # ~200 KB: more than the first window
    _log(store, job_id, "\n".join(lines) + "\n")
    rc, out, _ = run("logs", job_id, "--tail", "3")
    assert rc == 0 and out.splitlines() == lines[-3:]
    rc, out, _ = run("logs", job_id, "-n", "15000", "--follow")  # the job has ended: stops
    assert rc == 0 and out.splitlines() == lines[-15000:]
    assert ty.log_tail(job_id, 0)["data"] == ""
    assert ty.log_tail(job_id, 30_000)["data"].splitlines() == lines
    rc, _, err = run("logs", job_id, "--tail", "3", "--offset", "5")
    assert rc == 2 and "not allowed with" in err


def test_logs_rank_is_passed_on_and_checked(run: Run, store: Store) -> None:
    job_id = store.job(state="succeeded")
    _log(store, job_id, "only rank 0\n")
    rc, out, _ = run("logs", job_id, "--rank", "0")
    assert rc == 0 and out == "only rank 0\n"
    rc, _, err = run("logs", job_id, "--rank", "1")
    assert rc == 2 and "rank: the job has 1 rank(s)" in err, err
    rc, _, err = run("logs", job_id, "--rank", "-1")
    assert rc == 2 and "must be a rank" in err


def test_last_lines_never_shows_the_middle_of_a_line() -> None:
    assert _last_lines("a\nb\nc\n", 2, True, False) == "b\nc\n"
    assert _last_lines("a\nb\nc", 2, True, False) == "b\nc"
    assert _last_lines("a\nb\n", 5, True, False) == "a\nb\n"  # the log's start: all of it
    assert _last_lines("ne a\nb\n", 5, False, False) is None  # may begin earlier: read more
    assert _last_lines("ne a\nb\n", 5, False, True) == "b\n"  # the most read: whole lines


def test_ctrl_c_while_following_is_a_note_not_an_error(
    run: Run, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = store.job(state="running")

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Client, "follow_logs", interrupted)
    monkeypatch.setattr(Client, "stream_events", interrupted)
    for argv in (["logs", job_id, "--follow"], ["status", job_id, "--follow"]):
        rc, _, err = run(*argv)
        assert rc == 130 and "stopped following" in err and "error" not in err, argv
    monkeypatch.setattr(Client, "jobs", interrupted)
    rc, _, err = run("list")
    assert rc == 130 and err == "interrupted\n"


def test_the_first_plain_progress_line_has_epoch_and_step(ty: Client, store: Store) -> None:
    """A job seen running before its first step: no progress line until the step is known,
    so the first plain line (the one shown for seconds) has epoch and step."""
    job_id = ty.submit(SPEC)["id"]
    store.set_state(job_id, "starting")
    store.set_state(job_id, "running")
    stream = io.StringIO()

    def train() -> None:
        deadline = time.monotonic() + 20
        while f"{job_id[:12]} running" not in stream.getvalue():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        for k in range(1, STEPS + 1):
            store.metrics(job_id, range(k, k + 1))
            store.progress(job_id, k)
        store.set_state(job_id, "succeeded")

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    assert follow_job(ty, job_id, interval_s=0, stream=stream) == 0
    worker.join(5)
    lines = stream.getvalue().splitlines()
    at = lines.index(f"{job_id[:12]} running")
    progress = lines[at + 1]
    assert "epoch 1" in progress and f"/{STEPS}" in progress, lines


def test_init_from_job_takes_a_unique_prefix_as_every_command_does(
    store: Store, ty: Client
) -> None:
    src = store.job(state="succeeded")
    with pytest.raises(errors.InvalidSpec) as e:  # found by its prefix: it has no weights
        ty.submit({**SPEC, "init": {"from_job": src[:8], "checkpoint": "weights"}})
    assert f"job {src} (succeeded) has no final weights" in str(e.value)
    other = "0" * 8 if not src.startswith("0" * 8) else "f" * 8
    with pytest.raises(errors.NotFound, match=r"init\.from_job: no job id starts with"):
        ty.submit({**SPEC, "init": {"from_job": other}})
