"""The dashboard's state lists (`web/src/states.gen.js`) are generated from
contracts/states.py and committed, so the build needs no Python: this fails when the
committed file is out of date, naming the command that regenerates it. No browser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from torchyard.contracts.states import AttemptState, JobState, js_module, state_lists

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "web" / "src" / "states.gen.js"
REGENERATE = "python -m torchyard.contracts.states --js web/src/states.gen.js"
# Quoted state names: no page keeps a hand copy of one (it imports ../states.gen.js).
_STATE_LITERAL = re.compile(
    r"""["'](queued|starting|running|cancelling|succeeded|failed|cancelled|lost|handed_back|idle|busy|stopped)["']"""
)


def test_the_generated_module_is_up_to_date() -> None:
    committed = GENERATED.read_text(encoding="utf-8") if GENERATED.exists() else ""
    assert committed == js_module(), f"web/src/states.gen.js is out of date: run `{REGENERATE}`"


def _exported(text: str, name: str) -> object:
    """The JSON literal a generated `export const NAME = ...(literal);` line holds."""
    m = re.search(rf"^export const {name} = (?:new )?[\w.]+\((.*)\);$", text, re.MULTILINE)
    assert m is not None, name
    return json.loads(m.group(1))


def test_the_command_writes_the_contracts_lists(tmp_path: Path) -> None:
    out = tmp_path / "states.gen.js"
    cmd = [sys.executable, "-m", "torchyard.contracts.states", "--js", str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path)
    text = out.read_text(encoding="utf-8")
    assert text == js_module()
    lists = state_lists()
    assert _exported(text, "JOB_STATES") == [s.value for s in JobState]
    assert _exported(text, "JOB_TERMINAL") == lists["job"]["terminal"]
    assert _exported(text, "JOB_TRANSITIONS") == lists["job"]["transitions"]
    assert _exported(text, "ATTEMPT") == {s.name: s.value for s in AttemptState}
    assert _exported(text, "WORKER_LIVE") == lists["worker"]["live"]


def test_no_page_keeps_its_own_state_names() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "web" / "src").rglob("*.js"))
        if path != GENERATED
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _STATE_LITERAL.search(line)
    ]
    assert not offenders, "state names belong in states.gen.js:\n" + "\n".join(offenders)
