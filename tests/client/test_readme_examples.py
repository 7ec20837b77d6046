"""The README's examples run exactly as written against a real `torchyard up` (API,
scheduler, 2 CPU workers): the console session of "Using it" (its `$` lines, in one bash,
and its output lines, numbers and ids aside), the SDK example of "Python SDK" and the
`torchyard.load_model` example of "The CLI". They run from a directory of their own that
has no `.torchyard`: the CLI and the SDK find the server through the login file `up` wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from up_server import JOB_S, ROOT, Up

pytestmark = pytest.mark.e2e

README = (ROOT / "README.md").read_text()
_BAR = re.compile("[━╸╺]")
# An id or a sha256 (hex with a digit in it), or a number (12, 0.0543, 72,621, 0:06).
_VARIES = re.compile(r"(\b(?=[0-9a-f]*\d)[0-9a-f]{6,}\b|\d[\d.,:]*)")


def section(title: str) -> str:
    """The text under a heading of that title, to the next heading of its level or above."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", README, re.M)
    assert m, f"README has no section {title!r}"
    rest = README[m.end() :]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def output_pattern(line: str) -> re.Pattern[str]:
    """A README output line as a pattern: ids, hashes and numbers may differ, runs of
    spaces may be any whitespace; everything else is as written."""
    parts = _VARIES.split(line.strip())
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(r"[0-9a-f]+" if re.search("[a-f]", part) else r"[\d.,:]+")
        else:
            out.append(re.sub(r"(\\ )+", r"\\s+", re.escape(part)))
    return re.compile("".join(out))


def test_output_pattern_keeps_words_and_lets_numbers_vary() -> None:
    pat = output_pattern("job e6ce7e5045da succeeded in 0:06 — val/loss 0.1128")
    assert pat.search("job 0b1c2d3e4f56 succeeded in 0:11 — val/loss 0.2")
    assert not pat.search("job 0b1c2d3e4f56 failed in 0:11 — val/loss 0.2")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    server = Up.in_temp(tmp_path_factory.mktemp("tyreadme"))
    server.start()
    yield server
    assert server.stop() == 0, server.log.read_text()


@pytest.fixture(scope="module")
def user(up: Up, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A directory with the repository's examples and no `.torchyard`, and an environment
    with the venv's `torchyard` on PATH and nothing that names the server but the login
    file."""
    work = tmp_path_factory.mktemp("user")
    (work / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["TORCHYARD_CONFIG"] = str(up.config)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return work, env


@pytest.fixture(scope="module")
def session(user: tuple[Path, dict[str, str]]) -> subprocess.CompletedProcess[str]:
    """The `$` lines of "Using it", in one bash (JOB carries from one to the next)."""
    lines = [ln for b in blocks(section("Using it"), "console") for ln in b.splitlines()]
    script = "\n".join(["set -euo pipefail", *(ln[2:] for ln in lines if ln.startswith("$ "))])
    work, env = user
    return subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True,
        timeout=JOB_S,
    )  # fmt: skip


def test_up_saved_a_private_login_file(up: Up) -> None:
    assert up.config.stat().st_mode & 0o777 == 0o600
    saved = json.loads(up.config.read_text())
    assert saved["url"] == f"http://127.0.0.1:{up.port}" and saved["saved_by"] == "up"
    assert saved["token"] == (up.home / "admin-token").read_text().strip()


def test_the_console_session_runs_as_written(session: subprocess.CompletedProcess[str]) -> None:
    assert session.returncode == 0, session.stdout + session.stderr
    text = section("Using it")
    expected = [
        ln
        for b in blocks(text, "console")
        for ln in b.splitlines()
        if ln.strip() and not ln.startswith("$ ") and not _BAR.search(ln)
    ]
    assert len(expected) >= 10, "the session lost its output lines"
    out = session.stdout + session.stderr
    missing = [ln for ln in expected if not output_pattern(ln).search(out)]
    assert not missing, f"not in the output:\n{missing}\n---\n{out}"


def _run_python(block: str, user: tuple[Path, dict[str, str]]) -> str:
    work, env = user
    r = subprocess.run(
        [sys.executable, "-c", block], cwd=work, env=env, capture_output=True, text=True,
        timeout=JOB_S,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_load_model_example_runs_as_written(
    session: subprocess.CompletedProcess[str], user: tuple[Path, dict[str, str]]
) -> None:
    assert session.returncode == 0, session.stderr
    (block,) = [b for b in blocks(section("The CLI"), "python") if "load_model(" in b]
    name, accuracy = _run_python(block, user).split()
    assert name in "0123456789" and float(accuracy) > 0.9


def test_the_sdk_example_runs_as_written(user: tuple[Path, dict[str, str]]) -> None:
    (block,) = blocks(section("Python SDK"), "python")
    out = _run_python(block, user).splitlines()
    m = re.fullmatch(r"val/accuracy (0\.\d{4}) at step (\d+)", out[0])
    assert m and float(m.group(1)) > 0.9 and int(m.group(2)) > 0, out
    state, path, sha = out[1].split()
    assert state == "succeeded" and path == "digits.safetensors" and len(sha) == 64
    assert (user[0] / path).stat().st_size > 0
