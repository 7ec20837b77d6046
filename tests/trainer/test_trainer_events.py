"""Every event line says which attempt wrote it (TORCHYARD_ATTEMPT, set by the worker), and
the lifecycle events (`started`, `finished`, `stopped`, `error`) say which process: a later
attempt's supervisor tells its own trainer's lines from an earlier one's in the shared file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from trainer_testlib import REPO, make_spec, read_events, trainer_cmd, trainer_env, write_spec

from torchyard.trainer import exitcodes
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
