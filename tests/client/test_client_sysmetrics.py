"""`torchyard metrics JOB --system` and the training view without the system series, against
the real app: a job's `sys/…` points (time-indexed, as the worker writes them) beside its
training curves."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from client_server import Run, Store

from torchyard.client.sysview import NAMES_PER_REQUEST_CHARS, name_batches
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics

T0 = 1_780_000_000  # a Unix second: 2026-05-28 20:26:40 UTC


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(
        "name: t\nmodel: {name: mlp, hidden: [16]}\n"
        "data: {name: synthetic, shape: [1, 8, 8], num_classes: 4, size: 64}\n"
        "optimizer: {name: sgd, lr: 0.1}\nepochs: 2\n"
    )
    return p


def _with_system(run: Run, spec: Path, store: Store) -> str:
    rc, out, err = run("submit", str(spec))
    assert rc == 0, err
    job_id = out.strip()
    store.run(job_id)
    rows = []
    for i, (cpu, rss, util) in enumerate([(50.0, 3 * 2**30, 90.0), (150.0, 2**30, 10.0),
                                          (75.5, 2 * 2**30, 55.0)]):  # fmt: skip
        t = T0 + 5 * i
        for name, v in (("sys/cpu_percent", cpu), ("sys/rss_bytes", rss),
                        ("sys/rank1/gpu_util_percent", util)):  # fmt: skip
            rows.append({"name": name, "step": t, "epoch": None, "value": v, "time": t + 0.25})
    with session_scope(store.url) as s:
        ingest_metrics(s, job_id, rows)
    return job_id


def test_the_training_view_leaves_the_system_series_out(run: Run, spec: Path, store: Store) -> None:
    job_id = _with_system(run, spec, store)
    rc, out, _ = run("metrics", job_id, "--csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert rc == 0 and rows[0] == ["step", "train/loss", "val/loss"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    rc, out, _ = run("metrics", job_id)
    assert rc == 0 and out.split()[:3] == ["step", "train/loss", "val/loss"] and "sys/" not in out
    rc, out, _ = run("status", job_id)
    assert rc == 0 and "train/loss" in out and "sys/" not in out
    # Named, a system series is shown like any other (its step a Unix second).
    rc, out, _ = run("metrics", job_id, "--name", "sys/cpu_percent", "--csv")
    assert rc == 0 and out.splitlines() == [
        "step,sys/cpu_percent",
        f"{T0},50.0",
        f"{T0 + 5},150.0",
        f"{T0 + 10},75.5",
    ]


def test_system_summary_and_csv_by_time(run: Run, spec: Path, store: Store) -> None:
    job_id = _with_system(run, spec, store)
    rc, out, _ = run("metrics", job_id, "--system")
    assert rc == 0
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert lines["sys/cpu_percent"][1:4] == ["75.5%", "50.0%", "150.0%"]  # latest, min, max
    assert lines["sys/rss_bytes"][1:7] == ["2.0", "GiB", "1.0", "GiB", "3.0", "GiB"]
    assert lines["sys/rank1/gpu_util_percent"][1:4] == ["55.0%", "10.0%", "90.0%"]
    assert "2026-05-28 20:26:40" in out and "2026-05-28 20:26:50" in out
    assert "train/loss" not in out
    rc, out, _ = run("metrics", job_id, "--system", "--csv")
    assert rc == 0 and out.splitlines() == [
        "time,sys/cpu_percent,sys/rank1/gpu_util_percent,sys/rss_bytes",
        f"{T0},50.0,90.0,{3 * 2**30}.0",
        f"{T0 + 5},150.0,10.0,{2**30}.0",
        f"{T0 + 10},75.5,55.0,{2 * 2**30}.0",
    ]
    rc, out, _ = run("metrics", job_id, "--system", "--name", "sys/rss_bytes")
    assert rc == 0 and "sys/rss_bytes" in out and "sys/cpu_percent" not in out
    rc, _, err = run("metrics", job_id, "--system", "--plot")
    assert rc == 2 and "--system shows a table or --csv" in err


def test_system_of_a_job_without_samples_is_exit_1(run: Run, spec: Path, store: Store) -> None:
    _, out, _ = run("submit", str(spec))
    job_id = out.strip()
    store.run(job_id)
    rc, _, err = run("metrics", job_id, "--system")
    assert rc == 1 and err.startswith(f"error: no system metrics for job {job_id}")


def test_names_are_asked_for_in_few_short_requests() -> None:
    names = [f"train/metric_{i:04d}" for i in range(300)]
    batches = name_batches(names)
    assert ",".join(batches).split(",") == names
    assert all(len(b) <= NAMES_PER_REQUEST_CHARS for b in batches) and len(batches) < 10
