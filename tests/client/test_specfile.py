"""Spec files as their authors meant them: every number a number (YAML 1.2 floats, not PyYAML's
1.1 rule that makes `1e-3` a string), syntax errors located with the line and a caret, and a
submit's warnings printed on stderr."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from client_server import SPEC
from fastapi.testclient import TestClient

from torchyard.client import errors
from torchyard.client.cli import main
from torchyard.client.sdk import load_spec
from torchyard.client.specfile import format_warnings, parse_yaml, print_warnings

NUMBERS = [
    ("1e-3", 0.001),
    ("3e4", 30000.0),
    (".5", 0.5),
    ("-2.5E+3", -2500.0),
    ("1.5e3", 1500.0),
    ("1E5", 100000.0),
    ("+.5e1", 5.0),
    ("1.", 1.0),
    ("0.9", 0.9),
    ("10", 10),
    ("-3", -3),
    ("0x10", 16),
]
TEXT = ["1e-3x", "1.2.3", "e5", "5e", "1e", "v1.0", "2024-01-01", "1.0.0-rc1", '"1e-3"']


@pytest.mark.parametrize(("written", "value"), NUMBERS)
def test_every_number_a_person_writes_is_a_number(written: str, value: float) -> None:
    got = parse_yaml(f"lr: {written}\n")["lr"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("written", TEXT)
def test_text_that_is_not_a_number_stays_text(written: str) -> None:
    got = parse_yaml(f"v: {written}\n")["v"]
    assert isinstance(got, str) and got == written.strip('"')


def test_pyyaml_itself_is_left_as_it_was() -> None:
    """The loader is a subclass with its own rules: SafeLoader (used by others) is unchanged."""
    parse_yaml("a: 1e-3\n")
    assert yaml.safe_load("a: 1e-3\n") == {"a": "1e-3"}


def test_load_spec_reads_lr_1e_3_as_a_number(tmp_path: Path) -> None:
    p = tmp_path / "spec.yaml"
    p.write_text("optimizer: {name: adam, lr: 1e-3, weight_decay: 5e-4}\nbatch_size: 64\n")
    spec = load_spec(p)
    assert spec == {"optimizer": {"name": "adam", "lr": 0.001, "weight_decay": 0.0005},
                    "batch_size": 64}  # fmt: skip
    json.dumps(spec)  # all JSON: nothing the request could not send


def _refused(p: Path, text: str) -> tuple[Path, list[str]]:
    """Write `text` to `p` and load it: the SpecFileError's lines."""
    p.write_text(text)
    with pytest.raises(errors.SpecFileError) as err:
        load_spec(p)
    return p, str(err.value).splitlines()


def test_a_yaml_syntax_error_shows_line_column_and_a_caret(tmp_path: Path) -> None:
    p, lines = _refused(
        tmp_path / "bad.yaml", "model: {name: mlp}\noptimizer:\n  name: sgd\n  lr: 0.1: 2\n"
    )
    assert lines[0] == f"{p}:4:10: not valid YAML: mapping values are not allowed here"
    assert lines[1:] == ["  4 |   lr: 0.1: 2", "    |          ^"]
    assert lines[2].index("^") == lines[1].index(": 2")  # the caret is under the spot


def test_an_unclosed_bracket_points_where_yaml_noticed(tmp_path: Path) -> None:
    p, (first, source, caret) = _refused(
        tmp_path / "bad.yaml", "model: [unclosed\ndata: {name: digits}\n"
    )
    assert first.startswith(f"{p}:2:") and "not valid YAML" in first
    assert "while parsing a flow sequence" in first  # the context, named
    assert source == "  2 | data: {name: digits}" and caret.endswith("^")


def test_a_json_syntax_error_is_located_the_same_way(tmp_path: Path) -> None:
    p, lines = _refused(
        tmp_path / "bad.json", '{\n  "model": {"name": "mlp"},\n  "epochs": 5,\n}\n'
    )
    assert lines == [
        f"{p}:4:1: not valid JSON: Expecting property name enclosed in double quotes",
        "  4 | }",
        "    | ^",
    ]


def test_tabs_keep_the_caret_in_place(tmp_path: Path) -> None:
    _, (_, source, caret) = _refused(tmp_path / "bad.json", '{\n\t"a": tru\n}\n')
    assert source == '  2 | \t"a": tru' and caret == "    | \t     ^"


def test_a_submit_shows_its_warnings_on_stderr() -> None:
    job = {"id": "x", "warnings": [{"field": "world_size", "message": "4 is more than 2"}]}
    assert format_warnings(job) == ["warning: world_size: 4 is more than 2"]
    assert format_warnings({"id": "x"}) == [] and format_warnings({"warnings": None}) == []
    out = io.StringIO()
    print_warnings(job, file=out)
    assert out.getvalue() == "warning: world_size: 4 is more than 2\n"


def test_the_cli_prints_the_servers_warnings_and_still_succeeds(
    http: TestClient, token: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec: dict[str, Any] = {**SPEC, "batch_size": 64, "world_size": 2}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    rc = main(["submit", str(p), "--token", token], http=http)
    out, err = capsys.readouterr()
    assert rc == 0 and len(out.split()) == 1  # stdout: the job id only
    warned = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert [ln.split(":")[1].strip() for ln in warned] == ["batch_size", "world_size"], err
    assert "51 samples" in warned[0] and "no worker" not in warned[1]
    assert "2 is more than the 0 workers registered now (none)" in warned[1]


@pytest.fixture
def run_yaml(
    http: TestClient, token: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Callable[[str], tuple[int, str]]:
    def run(text: str) -> tuple[int, str]:
        p = tmp_path / "spec.yaml"
        p.write_text(text)
        rc = main(["submit", str(p), "--token", token], http=http)
        return rc, capsys.readouterr().err

    return run


def test_lr_1e_3_in_yaml_is_accepted_end_to_end(run_yaml: Callable[[str], tuple[int, str]]) -> None:
    body = "model: {name: mlp}\ndata: {name: digits}\nbatch_size: 32\n"
    rc, err = run_yaml(body + "optimizer: {name: adam, lr: 1e-3}\n")
    assert rc == 0, err
    # The server names the value it got when the type is wrong.
    rc, err = run_yaml(body + "optimizer: {name: adam, lr: '1e-3'}\n")
    assert rc == 2 and 'optimizer.lr: must be a number, got "1e-3" (a string)' in err
