"""`job.save_artifact`: a file or bytes kept with a script job under `artifacts/<name>`,
written atomically and announced as an `artifact` event the worker's rules accept; names a
hostile script could use to leave the folder are refused before anything is written; by hand
the file lands in ./torchyard-run/artifacts/. All in this process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from torchyard import job
from torchyard.contracts import exitcodes
from torchyard.contracts.eventmodel import (
    ARTIFACT_NAME,
    event_problem,
    parse_event,
)
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.distributed import Dist
from torchyard.trainer.events import MemoryEvents
from torchyard.trainer.loop import Run
from torchyard.trainer.script import run_script
from torchyard.trainer.signals import StopFlag

SCRIPT = """\
from pathlib import Path
from torchyard import job
job.setup()
job.log(3, loss=0.5)
Path("cfg.yaml").write_text("lr: 0.1\\n")
job.save_artifact("cfg.yaml")
job.save_artifact(b"first", name="notes.txt")
job.save_artifact(bytearray(b"second"), name="notes.txt")
"""


def _run(tmp_path: Path, body: str) -> tuple[int, MemoryEvents, Path]:
    bundle, run_dir = tmp_path / "bundle", tmp_path / "run"
    bundle.mkdir()
    run_dir.mkdir()
    (bundle / "s.py").write_text(body)
    events = MemoryEvents()
    r = Run(run_dir=run_dir, dist=Dist(rank=0, local_rank=0, world_size=1,
            device=torch.device("cpu")), events=events, data_root=tmp_path,
            resume=None, stop=StopFlag(), log=lambda _s: None)  # fmt: skip
    spec = parse_spec({"code": {"bundle": "0" * 64}, "entrypoint": {"script": "s.py"}})
    return run_script(spec, r, bundle), events, run_dir


def test_a_script_saves_files_and_bytes_as_artifact_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, events, run_dir = _run(tmp_path, SCRIPT)
    assert code == exitcodes.OK
    arts = events.of_type("artifact")
    assert [(a["name"], a["path"], a["step"]) for a in arts] == [
        ("cfg.yaml", "artifacts/cfg.yaml", 3),
        ("notes.txt", "artifacts/notes.txt", 3),
        ("notes.txt", "artifacts/notes.txt", 3),
    ]
    assert (run_dir / "artifacts" / "notes.txt").read_bytes() == b"second"  # replaced
    assert arts[-1]["sha256"] == hashlib.sha256(b"second").hexdigest() and arts[-1]["bytes"] == 6
    assert arts[0]["sha256"] == hashlib.sha256(b"lr: 0.1\n").hexdigest()
    assert sorted(p.name for p in (run_dir / "artifacts").iterdir()) == ["cfg.yaml", "notes.txt"]
    for a in arts:  # what the worker reads back takes them
        assert event_problem(parse_event(a)) is None


@pytest.mark.parametrize(
    "name", ["../x", "a/b", ".hidden", ".", "..", "", "x" * 129, "a b", "é.png", "a\x00b"]
)
def test_names_that_could_leave_the_folder_are_refused_before_writing(
    tmp_path: Path, name: str
) -> None:
    body = f"from torchyard import job\njob.save_artifact(b'x', name={name!r})\n"
    code, events, run_dir = _run(tmp_path, body)
    assert code == exitcodes.FAILED
    (error,) = events.of_type("error")
    assert error["kind"] == "user_code" and "artifact: name" in error["message"]
    assert not (run_dir / "artifacts").exists() and not events.of_type("artifact")


def test_the_worker_rules_refuse_a_forged_artifact_event() -> None:
    ok = {"type": "artifact", "name": "a.png", "path": "artifacts/a.png", "sha256": "0" * 64}
    assert event_problem(parse_event(ok)) is None
    for bad in (
        {**ok, "path": "checkpoints/step-00000001.pt"},
        {**ok, "path": "artifacts/../events.jsonl"},
        {**ok, "name": "../a.png", "path": "artifacts/../a.png"},
        {**ok, "name": ".a", "path": "artifacts/.a"},
        {**ok, "sha256": "X" * 64},
        {**ok, "name": None},
    ):
        assert event_problem(parse_event(bad)) is not None, bad
    assert ARTIFACT_NAME.pattern == job.ARTIFACT_NAME.pattern  # the two copies agree


def test_save_artifact_checks_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name= is needed"):
        job.save_artifact(b"x")
    with pytest.raises(FileNotFoundError, match="no such file"):
        job.save_artifact(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="file path or bytes"):
        job.save_artifact(123)  # type: ignore[arg-type]


def test_by_hand_an_artifact_goes_to_the_local_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plot.png").write_bytes(b"\x89PNG...")
    try:
        job._install(job._LocalBackend())
        job.save_artifact(tmp_path / "plot.png")
        job.save_artifact(b"{}", name="cfg.json")
    finally:
        job._install(None)
    folder = tmp_path / "torchyard-run" / "artifacts"
    assert (folder / "plot.png").read_bytes() == b"\x89PNG..."
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.json", "plot.png"]
