"""The CLI against an in-memory API: exit codes, one-line errors, output formats."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from client_fake_api import FakeAPI

from torchyard.client import render
from torchyard.client.cli import main, progress_line, wide_rows


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


@pytest.fixture
def run(api: FakeAPI, capsys: pytest.CaptureFixture[str]):
    """run(*argv) -> (exit code, stdout, stderr), talking to the fake API."""

    def _run(*argv: str) -> tuple[int, str, str]:
        rc = main(
            [*argv, "--url", "http://ty.test", "--token", api.token], transport=api.transport()
        )
        out, err = capsys.readouterr()
        return rc, out, err

    return _run


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text("name: t\nmodel: {name: mlp}\ndata: {name: digits}\noptimizer: {name: sgd}\n")
    return p


def test_submit_follow_succeeds_prints_id_and_progress(run, spec: Path, api: FakeAPI) -> None:
    rc, out, err = run("submit", str(spec), "--follow", "--interval", "0")
    assert rc == 0
    (job_id,) = out.split()
    assert job_id in api.jobs
    assert "running" in err and f"job {job_id} succeeded" in err
    assert f"{api.steps}/{api.steps}" in err  # the final progress line
    assert "train/loss 0.5000" in err  # 2.0 / step 4: the latest loss is shown


def test_follow_of_a_failed_job_exits_1_with_its_error(run, spec: Path, api: FakeAPI) -> None:
    api.final_state = "failed"
    rc, _, err = run("submit", str(spec), "-f", "--interval", "0")
    assert rc == 1
    assert "failed" in err and "trainer exited with code 3" in err


def test_rejected_spec_is_one_line_and_exit_2(run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"optimizer": {"lr": 0}, "batch_size": 1.5}))
    rc, out, err = run("submit", str(bad))
    assert rc == 2 and out == ""
    assert err == (
        "error: 422 invalid spec: optimizer.lr: must be > 0; batch_size: must be an integer\n"
    )


def test_unparsable_spec_file_is_exit_2_without_traceback(run, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    rc, _, err = run("submit", str(bad))
    assert rc == 2
    assert err.startswith("error: ") and "not valid YAML" in err and "Traceback" not in err


def test_wrong_token_and_unknown_job_exit_1(api: FakeAPI, capsys) -> None:
    rc = main(["list", "--url", "http://ty.test", "--token", "ty_no"], transport=api.transport())
    assert rc == 1 and capsys.readouterr().err.startswith("error: 401 ")
    rc = main(
        ["status", "f" * 32, "--url", "http://ty.test", "--token", api.token],
        transport=api.transport(),
    )
    assert rc == 1 and capsys.readouterr().err == "error: 404 job not found\n"


def test_bad_option_is_exit_2(run) -> None:
    rc, _, err = run("metrics")
    assert rc == 2 and "required" in err


def test_status_list_workers_and_prefix_ids(run, spec: Path) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    rc, out, _ = run("status", job_id[:6])
    assert rc == 0 and job_id in out and "state" in out
    rc, out, _ = run("status", job_id, "--json")
    assert json.loads(out)["id"] == job_id
    rc, out, _ = run("list")
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert job_id[:12] in out
    rc, out, _ = run("workers")
    assert rc == 0 and "w0" in out and "idle" in out


def test_metrics_csv_and_plot(run, spec: Path, api: FakeAPI) -> None:
    _, out, _ = run("submit", str(spec), "-f", "--interval", "0")
    job_id = out.strip()
    rc, out, _ = run("metrics", job_id, "--csv")
    assert rc == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["step", "train/loss", "val/loss"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    assert float(rows[2][1]) == 1.0 and float(rows[2][2]) == 1.0 and rows[1][2] == ""
    rc, out, _ = run("metrics", job_id, "--plot")
    assert rc == 0 and "train/loss" in out and "val/loss" in out
    rc, out, _ = run("metrics", job_id, "--name", "val/loss")
    assert rc == 0 and out.splitlines()[0].split() == ["step", "val/loss"]


def test_download_reports_verified_sha_and_how_to_load(
    run, spec: Path, api: FakeAPI, tmp_path: Path
) -> None:
    _, out, _ = run("submit", str(spec))
    dest = tmp_path / "ck.pt"
    rc, out, err = run("download", out.strip(), "-o", str(dest))
    assert rc == 0 and dest.read_bytes() == api.blob
    assert f"sha256 {api.sha} verified" in out
    assert "weights_only=True" in out
    assert "100.0%" in err


def test_progress_line_and_wide_rows() -> None:
    job = {
        "spec": {"epochs": 5},
        "progress": {
            "step": 50,
            "total_steps": 100,
            "epoch": 2,
            "samples_per_s": 1234.5,
            "eta_s": 65,
        },
    }
    line = progress_line(job, {"train/loss": (50, 0.25)}, unicode=False)
    assert "epoch 2/5" in line and "50/100" in line and "1,234 samples/s" in line
    assert "ETA 1:05" in line and "train/loss 0.2500" in line
    assert render.bar(0.5, 10, unicode=False) == "#####-----"
    names, rows = wide_rows(
        {"b": {"steps": [2], "values": [1.0]}, "a": {"steps": [1, 2], "values": [3.0, 4.0]}}
    )
    assert names == ["a", "b"] and rows == [[1, 3.0, None], [2, 4.0, 1.0]]


def test_plot_marks_each_series_and_handles_empty() -> None:
    text = render.plot({"x": ([0, 1, 2], [3.0, 2.0, 1.0])}, width=20, height=5, unicode=False)
    grid = text.splitlines()[:5]
    assert grid[0].endswith("|*") and grid[-1].rstrip().endswith("*")  # high left, low right
    assert render.plot({"x": ([], [])}) == "(no data to plot)"
