"""Event lines keep their format, are checked against contracts/eventmodel.py before they are
written, and parse on the worker's side. Every event line says which attempt wrote it (TORCHYARD_ATTEMPT, set by the worker), and
the lifecycle events (`started`, `finished`, `stopped`, `error`) say which process: a later
attempt's supervisor tells its own trainer's lines from an earlier one's in the shared file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from trainer_testlib import REPO, make_spec, read_events, trainer_cmd, trainer_env, write_spec

from torchyard.contracts import exitcodes
from torchyard.contracts.eventmodel import event_dict, parse_event_line
from torchyard.trainer.events import (
    ATTEMPT_ENV,
    PID_EVENTS,
    JsonlEvents,
    MemoryEvents,
    attempt_from_env,
)

ALL_TYPES = ["started", "metric", "checkpoint", "progress", "finished", "error", "stopped"]


@pytest.mark.parametrize(("raw", "value"), [("1", 1), ("7", 7), ("2147483647", 2147483647)])
def test_attempt_from_env_reads_a_positive_integer(raw: str, value: int) -> None:
    assert attempt_from_env({ATTEMPT_ENV: raw}) == value


def test_attempt_is_none_when_run_by_hand() -> None:
    assert attempt_from_env({}) is None


@pytest.mark.parametrize(
    "raw",
    ["", "x", "1.0", "-1", "0", "+3", " 3", "3\n", "03", "\u0661", "\u00b2", "2147483648", "1e3"],
)
def test_attempt_from_env_refuses_anything_else_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ATTEMPT_ENV):
        attempt_from_env({ATTEMPT_ENV: raw})


@pytest.mark.parametrize("attempt", [4, None])
def test_sinks_stamp_attempt_on_every_event_and_pid_on_lifecycle_events(
    tmp_path: Path, attempt: int | None
) -> None:
    sink = JsonlEvents(tmp_path / "events.jsonl", attempt=attempt)
    mem = MemoryEvents(attempt=attempt)
    for t in ALL_TYPES:
        for s in (sink, mem):
            s.emit(t, step=1)
    sink.close()
    for events in (read_events(tmp_path), mem.events):
        assert [e["type"] for e in events] == ALL_TYPES
        for e in events:
            assert isinstance(e["time"], float) and e["step"] == 1
            if attempt is None:
                assert "attempt" not in e  # by hand: the field is left out, not null
            else:
                assert e["attempt"] == attempt
            if e["type"] in ("started", "finished", "stopped", "error"):
                assert e["pid"] == os.getpid()
            else:
                assert "pid" not in e
    assert {"started", "finished", "stopped", "error"} == PID_EVENTS


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.Popen, str, str]:
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=1, log_every_steps=5))
    proc = subprocess.Popen(trainer_cmd(spec, tmp_path / "run"),
                            env=trainer_env(OMP_NUM_THREADS="1", **env), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    return proc, out, err


@pytest.mark.e2e
def test_every_line_of_a_run_carries_the_attempt_and_rank0s_pid(tmp_path: Path) -> None:
    proc, out, err = _run(tmp_path, TORCHYARD_ATTEMPT="3")
    assert proc.returncode == exitcodes.OK, err
    events = read_events(tmp_path / "run")
    types = {e["type"] for e in events}
    assert {"started", "metric", "checkpoint", "progress", "finished"} <= types
    assert all(e["attempt"] == 3 for e in events)
    # `python -m torchyard.trainer` is rank 0 itself: its pid is the one the worker spawned
    for e in events:
        assert ("pid" in e) == (e["type"] in PID_EVENTS)
        if "pid" in e:
            assert e["pid"] == proc.pid and isinstance(e["time"], float)
    env = json.loads(out.splitlines()[0].removeprefix("environment: "))
    assert env["attempt"] == 3 and env["pid"] == proc.pid


@pytest.mark.e2e
def test_a_run_by_hand_writes_no_attempt(tmp_path: Path) -> None:
    env = {k: v for k, v in trainer_env().items() if k != ATTEMPT_ENV}
    spec = write_spec(tmp_path / "spec.json", make_spec(epochs=1))
    p = subprocess.run(trainer_cmd(spec, tmp_path / "run"), env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == exitcodes.OK, p.stderr
    events = read_events(tmp_path / "run")
    assert events and not [e for e in events if "attempt" in e]
    assert [e["type"] for e in events if "pid" in e] == ["started", "finished"]


@pytest.mark.parametrize("raw", ["two", "0", "1.5"])
def test_a_bad_attempt_variable_is_a_startup_error(tmp_path: Path, raw: str) -> None:
    proc, _out, err = _run(tmp_path, TORCHYARD_ATTEMPT=raw)
    assert proc.returncode == exitcodes.BAD_SPEC
    assert ATTEMPT_ENV in err and repr(raw) in err
    assert not (tmp_path / "run").exists()  # nothing written


# Each event type with the fields trainer/loop.py gives it.
FULL: dict[str, dict] = {
    "started": dict(world_size=2, device="cuda:0", device_name="H100", precision="bf16",
                    sync_batchnorm=False, deterministic=True,
                    versions={"torch": "2.5", "cudnn": None}, resumed_from=None, step=0,
                    epoch=0, total_steps=100, steps_per_epoch=10, loader="device",
                    train_samples=640, val_samples=64, parameters=1234),
    "metric": dict(step=5, epoch=1, name="train/lr", value=1),
    "checkpoint": dict(step=5, epoch=1, path="checkpoints/step-5.pt", bytes=10,
                       sha256="ab" * 32, kind="resume", pruned=["checkpoints/step-1.pt"]),
    "progress": dict(step=5, total_steps=100, epoch=1, samples_per_s=12.5, eta_s=None),
    "finished": dict(step=100, epoch=10, metrics={"train/loss": 0.1, "val/loss": float("nan")}),
    "stopped": dict(signal="SIGTERM", step=7, checkpoint="checkpoints/step-7.pt"),
    "error": dict(kind="data", message="no such file", step=0, rank=1),
}  # fmt: skip


def test_lines_keep_their_format_and_the_worker_reads_every_one(tmp_path: Path) -> None:
    sink = JsonlEvents(tmp_path / "events.jsonl", attempt=2)
    for t, fields in FULL.items():
        sink.emit(t, **fields)
    sink.close()
    lines = (tmp_path / "events.jsonl").read_bytes().splitlines()
    assert len(lines) == len(FULL)
    for line, (t, fields) in zip(lines, FULL.items(), strict=True):
        ev = json.loads(line)
        # the old format: type, time, the fields in the order given, attempt, then pid;
        # numbers as given (1 stays 1) and a NaN as null
        pid = ["pid"] if t in PID_EVENTS else []
        assert list(ev) == ["type", "time", *fields, "attempt", *pid]
        assert ev["type"] == t and ev["attempt"] == 2
        if t == "metric":
            assert line.decode().count('"value":1,') == 1
        if t == "finished":
            assert ev["metrics"] == {"train/loss": 0.1, "val/loss": None}
        parsed = parse_event_line(line)  # what the worker does with it
        assert parsed.type == t and event_dict(parsed) == ev


@pytest.mark.parametrize(
    ("type", "fields", "problem"),
    [
        ("launched", {"step": 1}, "unknown event type"),
        ("metric", {"step": 1, "nmae": "x"}, "undeclared field"),
        ("progress", {"step": 1, "pid": 3}, "undeclared field"),  # pid is lifecycle only
        ("metric", {"step": "1", "name": "x", "value": 1.0}, "step"),
        ("checkpoint", {"step": 1, "pruned": "a.pt"}, "pruned"),
        ("error", {"rank": True}, "rank"),
    ],
)
def test_a_malformed_event_is_refused_before_it_is_written(
    tmp_path: Path, type: str, fields: dict, problem: str
) -> None:
    sink = JsonlEvents(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match=problem):
        sink.emit(type, **fields)
    sink.close()
    assert (tmp_path / "events.jsonl").read_bytes() == b""
