"""The README documents every spec field, every setting and every CLI command, and its
main-job script does what the README says."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

from pydantic import BaseModel

from torchyard.cli import COMMANDS
from torchyard.contracts.spec import JobSpec
from torchyard.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _submodel(annotation: object) -> type[BaseModel] | None:
    """The model a field holds, also through `X | None`."""
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        sub = _submodel(f.annotation)
        if sub is not None:
            out += _fields(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_every_spec_field_is_in_the_reference() -> None:
    fields = _fields(JobSpec)
    assert "optimizer.lr" in fields and "checkpoint.keep_last" in fields
    missing = [f for f in fields if f"| `{f}` |" not in README]
    assert not missing, f"README spec reference lacks {missing}"


def test_every_setting_and_command_is_documented() -> None:
    for name in Settings.model_fields:
        assert f"`TORCHYARD_{name.upper()}`" in README, name
    for cmd in COMMANDS:
        assert f"`{cmd}" in README, cmd


def test_every_client_command_is_reachable_from_the_torchyard_command() -> None:
    """The `torchyard` dispatcher (torchyard/cli.py) knows every command the client's
    parser has: one added only to the parser would be `unknown command` to users."""
    import argparse

    from torchyard.client.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = sorted(set(subs.choices) - set(COMMANDS))
    assert not missing, f"add to torchyard/cli.py COMMANDS: {missing}"


def test_quick_start_has_the_two_commands_and_the_demo_script_is_sound() -> None:
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    block = quick.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in block] == [
        "bash scripts/demo.sh",
        "bash scripts/test.sh",
    ]
    demo = ROOT / "scripts" / "demo.sh"
    subprocess.run(["bash", "-n", str(demo)], check=True)
    text = demo.read_text()
    for step in (
        "-m venv .venv",
        "-c constraints.txt -e .",
        " up ",
        "examples/digits.json",
        "--follow",
        "--plot",
        " download ",
        "source .venv/bin/activate",  # how the README's bare `torchyard` gets on the PATH
    ):
        assert step in text, step
    # The start-up time it prints leaves the install out: the clock starts after pip.
    assert text.index("SECONDS=0", text.index("pip install")) < text.index("up in ${SECONDS}s")


def test_the_top_level_help_names_every_subcommand_of_a_group() -> None:
    """`torchyard --help` lists a group's actions (`sweep: create, status, …`): all of them."""
    import argparse

    from torchyard.client.cli import build_parser

    parser = build_parser()
    groups = {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }
    for name in ("sweep", "token"):
        subs = [
            a
            for action in groups[name]._actions
            if isinstance(action, argparse._SubParsersAction)
            for a in action.choices
        ]
        assert subs, name
        summary = COMMANDS[name][2]
        missing = [s for s in subs if s not in summary]
        assert not missing, f"torchyard --help says {name}: {summary!r}, without {missing}"
