"""The CLI against the real API (a TestClient of create_app on SQLite): exit codes,
one-line errors, output formats, --follow over the event stream."""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from client_server import BLOB, SPEC, STEPS, Recorder, Store
from fastapi.testclient import TestClient

from torchyard import cli as top
from torchyard.client import render
from torchyard.client.cli import follow_job, main, progress_line, wide_rows
from torchyard.client.sdk import Client

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(http: TestClient, token: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """run(*argv) -> (exit code, stdout, stderr), talking to the app."""

    def _run(*argv: str, token: str = token) -> tuple[int, str, str]:
        rc = main([*argv, "--token", token], http=http)
        out, err = capsys.readouterr()
        return rc, out, err

    return _run


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(
        "name: t\nmodel: {name: mlp, hidden: [16]}\n"
        "data: {name: synthetic, shape: [1, 8, 8], num_classes: 4, size: 64}\n"
        "optimizer: {name: sgd, lr: 0.1}\nepochs: 2\n"
    )
    return p


def test_submit_follow_succeeds_prints_id_and_progress(
    run: Run, spec: Path, store: Store, worker: Callable[..., None]
) -> None:
    worker()
    rc, out, err = run("submit", str(spec), "--follow", "--interval", "0")
    assert rc == 0, err
    (job_id,) = out.split()
    assert store.state(job_id) == "succeeded"
    lines = err.splitlines()
    states = [ln.split()[1] for ln in lines if ln.startswith(job_id[:12])]
    assert states == ["queued", "starting", "running", "succeeded"]
    assert f"{STEPS}/{STEPS}" in err  # the final progress line
    assert "train/loss 0.5000" in err  # 2.0 / step 4: the latest loss is shown
    assert f"job {job_id} succeeded" in err
    assert "\x1b[" not in err  # not a terminal: no ANSI codes


def test_follow_of_a_failed_job_exits_1_with_its_error(
    run: Run, spec: Path, worker: Callable[..., None]
) -> None:
    worker("failed", "trainer exited with code 3")
    rc, _, err = run("submit", str(spec), "-f", "--interval", "0")
    assert rc == 1
    assert "failed" in err and "error: trainer exited with code 3" in err


def test_status_follow_of_a_cancelled_job_replays_its_states(
    run: Run, spec: Path, store: Store
) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.set_state(job_id, "cancelled")
    rc, out, err = run("status", job_id, "--follow")
    assert rc == 1 and out == ""
    assert f"{job_id[:12]} queued" in err and f"job {job_id} cancelled" in err


def test_follow_resumes_where_the_stream_broke(
    http: TestClient, token: str, store: Store, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(Client, "reconnect_delay_s", 0.01)
    recorder = Recorder(http._transport)
    with httpx.Client(base_url="http://ty.test", transport=recorder) as h:
        job_id = Client(token=token, http=h).submit(SPEC)["id"]
        store.run(job_id)
        recorder.cut_events = 9  # of 14: status, 6 metrics, a checkpoint, 4 states, `end`
        rc = main(["status", job_id, "--follow", "--token", token], http=h)
    err = capsys.readouterr().err
    assert rc == 0, err
    states = [ln.split()[1] for ln in err.splitlines() if ln.startswith(job_id[:12])]
    assert states == ["queued", "starting", "running", "succeeded"]  # each once
    assert "API unreachable, retrying" in err and f"job {job_id} succeeded" in err
    streams = [r for r in recorder.requests if r.url.path.endswith("/events")]
    assert len(streams) == 2 and "Last-Event-ID" in streams[1].headers


def test_follow_waits_out_an_api_that_answers_503_at_first(
    http: TestClient, token: str, store: Store, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """An API that is up but not ready (its database away, or starting) answers 503: a
    follower started then waits for it, as it does for a broken stream, instead of exiting."""
    monkeypatch.setattr(Client, "reconnect_delay_s", 0.01)
    recorder = Recorder(http._transport)
    with httpx.Client(base_url="http://ty.test", transport=recorder) as h:
        job_id = Client(token=token, http=h).submit(SPEC)["id"]
        store.run(job_id)
        recorder.unavailable = 3
        rc = main(["status", job_id, "--follow", "--token", token], http=h)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert recorder.unavailable == 0 and "API unreachable, retrying" in err
    assert f"job {job_id} succeeded" in err


def test_follow_shows_each_new_pending_reason_of_a_queued_job(
    http: TestClient, token: str, store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = Recorder(http._transport)
    with httpx.Client(base_url="http://ty.test", transport=recorder) as h:
        job_id = Client(token=token, http=h).submit(SPEC)["id"]
        store.set_pending(job_id, "needs 1 worker, 0 idle")

        def scheduler() -> None:  # once the follower listens: a new reason, then the run
            while not any(r.url.path.endswith("/events") for r in recorder.requests):
                time.sleep(0.01)
            time.sleep(0.3)
            store.set_pending(job_id, "fair share: bob has used less")
            time.sleep(0.3)
            store.run(job_id)

        t = threading.Thread(target=scheduler, daemon=True)
        t.start()
        rc = main(["status", job_id, "--follow", "--token", token], http=h)
        t.join(10)
    err = capsys.readouterr().err
    assert rc == 0, err
    queued = [ln for ln in err.splitlines() if ln.startswith(f"{job_id[:12]} queued")]
    assert queued == [
        f"{job_id[:12]} queued: needs 1 worker, 0 idle",
        f"{job_id[:12]} queued: fair share: bob has used less",
    ]


def test_rejected_spec_is_one_line_and_exit_2(run: Run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"name": "mlp"}, "optimizer": {"lr": 0}}))
    rc, out, err = run("submit", str(bad))
    assert rc == 2 and out == ""
    assert err.startswith("error: 422 ") and err.count("\n") == 1
    assert "optimizer.lr" in err and "data" in err


def test_unparsable_spec_file_is_exit_2_without_traceback(run: Run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    rc, _, err = run("submit", str(bad))
    assert rc == 2
    assert err.startswith("error: ") and "not valid YAML" in err and "Traceback" not in err


def test_wrong_token_and_unknown_job_exit_1(run: Run) -> None:
    rc, _, err = run("list", token="ty_no")
    assert rc == 1 and err.startswith("error: 401 ")
    rc, _, err = run("status", "f" * 32)
    assert rc == 1 and err.startswith("error: 404 ") and err.count("\n") == 1


def test_bad_option_is_exit_2(run: Run) -> None:
    rc, _, err = run("metrics")
    assert rc == 2 and "required" in err


def test_status_list_workers_and_prefix_ids(run: Run, spec: Path, store: Store) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    rc, out, _ = run("status", job_id[:6])
    assert rc == 0 and job_id in out and "queued (attempt 1)" in out
    rc, out, _ = run("status", job_id, "--json")
    assert json.loads(out)["id"] == job_id
    rc, out, _ = run("list")
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert out.splitlines()[1].split()[:3] == [job_id[:12], "t", "queued"]
    store.worker("w-gpu0")
    rc, out, _ = run("workers")
    assert rc == 0 and "w-gpu0" in out and "idle" in out
    rc, out, _ = run("workers", "--json")
    assert [w["id"] for w in json.loads(out)] == ["w-gpu0"]


def test_a_pruned_trial_reads_pruned_in_list_and_status(run: Run, spec: Path, store: Store) -> None:
    from sqlalchemy import update

    from torchyard.store.db import session_scope
    from torchyard.store.models import Job, SweepTrial
    from torchyard.store.sweeps import NewSweep, create_sweep

    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.set_state(job_id, "cancelled")
    with session_scope(store.url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        sid = create_sweep(s, job.owner_id, NewSweep(
            name="s", spec=job.spec, space={"seed": {"type": "categorical", "choices": [1, 2]}},
            metric="val/accuracy", mode="max", max_trials=2, parallel=1, sampler="grid",
            pruner="asha", seed=0)).id  # fmt: skip
        s.execute(update(Job).where(Job.id == job_id).values(sweep_id=sid))
        s.add(SweepTrial(sweep_id=sid, number=0, job_id=job_id, params={}, outcome="pruned"))
    rc, out, _ = run("list")
    assert rc == 0 and out.splitlines()[1].split()[:3] == [job_id[:12], "t", "pruned"]
    rc, out, _ = run("status", job_id)
    assert rc == 0 and "pruned by its sweep (cancelled) (attempt 1)" in out


def test_json_output_is_the_api_body_as_before(
    run: Run, spec: Path, http: TestClient, token: str
) -> None:
    _, out, _ = run("submit", str(spec), "--json")
    job = json.loads(out)
    body = http.get(f"/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {token}"})
    rc, out, _ = run("status", job["id"], "--json")
    assert rc == 0 and out == json.dumps(body.json(), indent=2, sort_keys=False) + "\n"


def test_metrics_csv_table_and_plot(run: Run, spec: Path, store: Store) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.run(job_id)
    rc, out, _ = run("metrics", job_id, "--csv")
    assert rc == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["step", "train/loss", "val/loss"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    assert float(rows[2][1]) == 1.0 and float(rows[2][2]) == 1.0 and rows[1][2] == ""
    rc, out, _ = run("metrics", job_id, "--plot", "--width", "40", "--height", "8")
    assert rc == 0 and out.rstrip().endswith("* train/loss   o val/loss")
    assert "\x1b[" not in out and "step" in out
    rc, out, _ = run("metrics", job_id, "--name", "val/loss")
    assert rc == 0 and out.splitlines()[0].split() == ["step", "val/loss"]
    assert [ln.split() for ln in out.splitlines()[1:]] == [["2", "1"], ["4", "0.5000"]]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plot_is_coloured_on_a_terminal_unless_no_color(
    run: Run, spec: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.run(job_id)
    for env in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    plots = []
    for no_color in (False, True):
        if no_color:
            monkeypatch.setenv("NO_COLOR", "1")
        tty = _Tty()
        monkeypatch.setattr("sys.stdout", tty)
        assert run("metrics", job_id, "--plot")[0] == 0
        plots.append(tty.getvalue())
    assert "\x1b[38;5;" in plots[0]  # each series its colour
    assert "\x1b[" not in plots[1] and "* train/loss" in plots[1]


def test_follow_on_a_terminal_redraws_one_line_in_place(
    ty: Client, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    job_id = ty.submit(SPEC)["id"]
    store.run(job_id)
    tty = _Tty()
    assert follow_job(ty, job_id, stream=tty) == 0
    text = tty.getvalue()
    assert "\x1b[2K" in text  # rich erased the live line to redraw it
    assert f"{STEPS}/{STEPS}" in text and f"job {job_id} succeeded" in text


def test_a_long_metrics_table_is_downsampled_and_says_so(
    run: Run, spec: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.metrics(job_id, range(1, 41))
    monkeypatch.setattr("torchyard.client.cmd_results.TABLE_MAX_ROWS", 10)
    rc, out, err = run("metrics", job_id, "--name", "train/loss")
    rows = out.splitlines()[1:]
    assert rc == 0 and 1 < len(rows) <= 10 and rows[-1].split() == ["40", "0.05000"]
    assert err.startswith("note: 10 rows at most") and "--csv" in err
    rc, out, err = run("metrics", job_id, "--name", "train/loss", "--csv")
    assert len(out.splitlines()) == 41 and err == ""  # CSV keeps every point


def test_metrics_of_a_job_without_any_is_exit_1(run: Run, spec: Path) -> None:
    _, out, _ = run("submit", str(spec))
    rc, _, err = run("metrics", out.strip())
    assert rc == 1 and err == f"error: no metrics yet for job {out.strip()}\n"


def test_download_reports_verified_sha_and_how_to_load(
    run: Run, spec: Path, store: Store, tmp_path: Path
) -> None:
    _, out, _ = run("submit", str(spec))
    store.checkpoint(out.strip())
    dest = tmp_path / "ck.pt"
    rc, out, err = run("download", out.strip(), "-o", str(dest))
    assert rc == 0 and dest.read_bytes() == BLOB
    assert f"sha256 {hashlib.sha256(BLOB).hexdigest()} verified" in out
    assert "weights_only=True" in out
    # Not a terminal: one summary line, no bar redrawn line after line.
    assert len(err.splitlines()) == 1, err
    assert err.startswith("downloaded 16.0 KiB in 0:0"), err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_download_progress_off_a_terminal_is_one_summary_line() -> None:
    """Piped (a log, CI): however many updates, one line at the end (issue 44, item 13)."""
    stream = io.StringIO()
    transfer = render.Transfer(stream, plain_every_s=0)  # old code: a line per update
    for done in range(0, 4096 + 1, 256):
        transfer(done, 4096)
    transfer.done(4096)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("downloaded 4.0 KiB in 0:00"), lines
    assert "\x1b[" not in stream.getvalue()


def test_download_summary_counts_a_resumed_part() -> None:
    assert render.summary(4096, 1024, 2.0) == (
        "downloaded 3.0 KiB in 0:02 (1.5 KiB/s); 1.0 KiB kept from before, 4.0 KiB in all"
    )
    assert render.summary(10, 0, 0.0) == "downloaded 10 B in 0:00"


def test_download_progress_on_a_terminal_still_draws_the_bar() -> None:
    stream = _Tty()
    transfer = render.Transfer(stream)
    transfer(0, 4096)
    transfer(2048, 4096)
    transfer.done(4096)
    out = stream.getvalue()
    assert "100%" in out and "4.0/4.0 KiB" in out and "downloaded" not in out


def test_progress_line_and_wide_rows() -> None:
    job = {
        "state": "running",
        "spec": {"epochs": 5},
        "progress": {
            "step": 50,
            "total_steps": 100,
            "epoch": 2,
            "samples_per_s": 1234.5,
            "eta_s": 65,
        },
    }
    line = render.to_text(progress_line(job, {"train/loss": (50, 0.25)}))
    assert "epoch 2/5" in line and "50/100" in line and "1,234 samples/s" in line
    assert "ETA 1:05" in line and "train/loss 0.2500" in line
    tiny = render.to_text(progress_line(job, {"train/loss": (50, 0.0012345)}))
    assert "train/loss 0.001234" in tiny  # 4 significant digits, not 0.0012
    assert "━" * 12 in line and "━" * 13 not in line  # half of a 24-wide bar
    names, rows = wide_rows(
        {"b": {"steps": [2], "values": [1.0]}, "a": {"steps": [1, 2], "values": [3.0, 4.0]}}
    )
    assert names == ["a", "b"] and rows == [[1, 3.0, None], [2, 4.0, 1.0]]


def test_plot_marks_each_series_and_handles_empty() -> None:
    text = render.plot({"x": ([0, 1, 2], [3.0, 2.0, 1.0])}, width=30, height=8)
    canvas = [ln for ln in text.splitlines() if "┤" in ln or "│" in ln][1:-1]
    top, bottom = canvas[0], canvas[-1]
    assert top.index("*") < bottom.index("*")  # high on the left, low on the right
    assert text.splitlines()[-1] == "* x" and "\x1b[" not in text
    colored = render.plot({"x": ([0, 1], [1.0, 2.0])}, width=30, height=8, color=True)
    assert "\x1b[" in colored
    assert render.plot({"x": ([], [])}) == "(no data to plot)"
    assert render.plot({"x": ([1], [0.0])}, log_y=True) == "(no data to plot)"


def test_tables_never_wrap_when_piped() -> None:
    long = "n" * 300
    text = render.to_text(render.table(["ID", "NAME", "N"], [("a", long, 1), ("b", "x", 22)]))
    lines = text.splitlines()
    assert len(lines) == 3 and long in lines[1]
    assert lines[1].rstrip().endswith(" 1") and lines[2].rstrip().endswith("22")  # right-aligned


def test_version_prints_the_package_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert top.main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"torchyard {importlib.metadata.version('torchyard')}\n", "")
    assert top.main(["-V"]) == 0 and capsys.readouterr().out == out
    assert "--version" in top.usage()
