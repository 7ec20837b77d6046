"""`torchyard metrics JOB [JOB ...] --tensorboard DIR`: the event files the client writes by
hand, read back with TensorBoard's own reader (EventAccumulator, every scalar kept): every
tag, step, wall time and value (as a float32) of two jobs in one DIR, one of them over
several pages of the metrics API; a second export replaces a run instead of adding to it.
The format's pieces (CRC32C, masking, the Event protobuf) against TensorBoard's own."""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path

import pytest
from client_server import SPEC, Run, Store
from fastapi.testclient import TestClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked

from torchyard.client import tbevents
from torchyard.client.tbexport import run_name
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics

T0 = 1_700_000_000.0


def _f32(v: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


def _points(store: Store, job: str, series: dict[str, list[tuple[int, float]]]) -> None:
    rows = [{"name": n, "step": s, "epoch": None, "value": v, "time": T0 + s * 0.25 + len(n)}
            for n, pts in series.items() for s, v in pts]  # fmt: skip
    with session_scope(store.url) as s:
        ingest_metrics(s, job, rows)


def _read(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


@pytest.fixture
def jobs(store: Store, http: TestClient) -> dict[str, dict[str, list[tuple[int, float]]]]:
    http.app.state.settings = http.app.state.settings.model_copy(  # type: ignore[attr-defined]
        update={"metrics_page_points": 100}
    )
    rng = random.Random(3)
    big = {  # 350 steps: four pages of 100
        "train/loss": [(k, rng.uniform(0, 3)) for k in range(350)],
        "val/accuracy": [(k, 1 / 3 + k) for k in range(0, 350, 50)],
    }
    small = {"train/loss": [(1, 2.5), (2, 1e-40), (3, 1e39)], "my metric/é": [(-2, -1.0)]}
    out = {}
    for name, series in (("resnet: big run", big), ("small", small)):
        job = store.job("alice", state="succeeded", spec={**SPEC, "name": name})
        _points(store, job, series)
        out[job] = series
    return out


def test_two_jobs_in_one_dir_read_back_by_tensorboard(
    run: Run, jobs: dict[str, dict[str, list[tuple[int, float]]]], tmp_path: Path, http: TestClient
) -> None:
    out_dir = tmp_path / "tb"
    ids = list(jobs)
    rc, out, err = run("metrics", ids[0], ids[1][:10], "--tensorboard", str(out_dir))
    assert rc == 0, err
    assert f"tensorboard --logdir {out_dir}" in err
    runs = sorted(p.name for p in out_dir.iterdir())
    assert runs == sorted([f"resnet_big_run-{ids[0][:8]}", f"small-{ids[1][:8]}"])
    assert f"357 points of 2 series (job {ids[0]})" in out
    for job, series in jobs.items():
        (run_dir,) = [p for p in out_dir.iterdir() if p.name.endswith(job[:8])]
        (event_file,) = list(run_dir.iterdir())
        assert event_file.name.startswith("events.out.tfevents.")
        assert event_file.name.endswith(".torchyard")
        got = _read(run_dir)
        assert sorted(got) == sorted(series)
        for tag, pts in series.items():
            want = [(T0 + s * 0.25 + len(tag), s, _f32(v) if abs(v) < 3.4e38 else math.inf)
                    for s, v in pts]  # fmt: skip
            assert got[tag] == want, tag


def test_a_second_export_replaces_the_run(
    run: Run, jobs: dict[str, dict[str, list[tuple[int, float]]]], tmp_path: Path
) -> None:
    job = next(iter(jobs))
    out_dir = tmp_path / "tb"
    for _ in range(2):
        assert run("metrics", job, "--tensorboard", str(out_dir))[0] == 0
    (run_dir,) = list(out_dir.iterdir())  # and no staging folder left
    assert len(list(run_dir.iterdir())) == 1
    assert len(_read(run_dir)["train/loss"]) == 350  # once each, not twice
    (run_dir / "notes.txt").write_text("mine")
    rc, _, err = run("metrics", job, "--tensorboard", str(out_dir))
    assert rc == 1 and "notes.txt" in err and (run_dir / "notes.txt").exists()


def test_several_jobs_need_tensorboard(run: Run, jobs: dict) -> None:
    a, b = list(jobs)
    rc, _, err = run("metrics", a, b)
    assert rc == 2 and "--tensorboard" in err


def test_run_names_are_sanitised() -> None:
    assert run_name({"name": "../../etc/passwd", "id": "ab" * 16}) == "etc_passwd-abababab"
    assert run_name({"name": "", "id": "cd" * 16}) == "job-cdcdcdcd"
    assert run_name({"name": "a b\nc", "id": "ef" * 16}) == "a_b_c-efefefef"


def test_crc32c_and_its_mask_match_tensorboards() -> None:
    assert tbevents.crc32c(b"123456789") == 0xE3069283
    assert tbevents.crc32c(b"") == 0
    assert tbevents.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert tbevents.crc32c(b"\xff" * 32) == 0x62A8AB43  # ... and of ones
    rng = random.Random(0)
    for n in (1, 7, 8, 100, 1000):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert tbevents.masked_crc32c(data) == tb_masked(data)


def test_events_decode_with_tensorboards_protobuf() -> None:
    ev = event_pb2.Event.FromString(tbevents.scalar_event(12.5, -7, "val/loss", 0.25))
    assert (ev.wall_time, ev.step) == (12.5, -7)
    (value,) = ev.summary.value
    assert (value.tag, value.simple_value) == ("val/loss", 0.25)
    first = event_pb2.Event.FromString(tbevents.version_event(3.0))
    assert first.file_version == "brain.Event:2" and first.wall_time == 3.0
    big = event_pb2.Event.FromString(tbevents.scalar_event(0.0, 2**62, "t" * 300, -1.5))
    assert big.step == 2**62 and big.summary.value[0].tag == "t" * 300
