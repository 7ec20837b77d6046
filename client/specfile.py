"""Reading a spec file (JSON or YAML) the way its author meant it, and showing a submit's
warnings.

YAML is read with PyYAML's safe loader, but numbers follow YAML 1.2: PyYAML keeps YAML
1.1's float rule, under which `1e-3`, `3e4` or `.5e1` are strings (1.1 wants a dot and a
signed exponent), so `lr: 1e-3` would reach the server as the string "1e-3". Here every
number a person writes is a number; ints stay ints, and text that is not a number
(`1e-3x`, `1.2.3`) stays text, and so do dates (JSON has none). A file that does not parse is reported with its line,
column, the line itself and a caret under the spot.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from torchyard.client.errors import SpecFileError

YAML_SUFFIXES = (".yaml", ".yml")
FLOAT_TAG = "tag:yaml.org,2002:float"
TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
# YAML 1.2 core schema floats that are not also ints: a dot or an exponent (or both), plus
# the special values. Ints are matched by PyYAML's int rule first, so `10` stays 10.
FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_FLOAT_FIRST = list("-+0123456789.")


@functools.cache
def spec_loader() -> type:
    """A SafeLoader whose float rule is YAML 1.2's (PyYAML is imported on first use: most
    commands never read a YAML file)."""
    import yaml

    class SpecLoader(yaml.SafeLoader):
        pass

    # A copy of SafeLoader's rules (SafeLoader itself is untouched) without its float rule,
    # and without its timestamp rule: a spec is JSON, which has no dates, so `2024-01-01`
    # (in a script's args, say) stays the text it is rather than a date JSON cannot send.
    SpecLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag not in (FLOAT_TAG, TIMESTAMP_TAG)]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    SpecLoader.add_implicit_resolver(FLOAT_TAG, FLOAT_RE, _FLOAT_FIRST)
    return SpecLoader


def is_yaml(path: Path) -> bool:
    return path.suffix.lower() in YAML_SUFFIXES


def parse_yaml(text: str) -> Any:
    """YAML text as Python values, numbers read as YAML 1.2 reads them."""
    import yaml

    return yaml.load(text, Loader=spec_loader())  # a SafeLoader: no Python objects


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """A spec file as a dict: `.yaml`/`.yml` as YAML (above), anything else as JSON. Raises
    SpecFileError: unreadable, not valid (where: line, column, the line and a caret), or
    not one object."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecFileError(f"cannot read {p}: {reason}") from None
    obj = _parse_yaml_file(p, text) if is_yaml(p) else _parse_json_file(p, text)
    if not isinstance(obj, dict):
        raise SpecFileError(f"{p} must hold one object (a mapping of spec fields)")
    return obj


def _parse_json_file(p: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise syntax_error(p, "JSON", e.msg, text, e.lineno - 1, e.colno - 1) from None


def _parse_yaml_file(p: Path, text: str) -> Any:
    import yaml

    try:
        return parse_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context or type(e).__name__
        if e.context and e.problem:
            problem = f"{problem} ({e.context})"
        if mark is None:
            raise SpecFileError(f"{p} is not valid YAML: {problem}") from None
        raise syntax_error(p, "YAML", problem, text, mark.line, mark.column) from None
    except yaml.YAMLError as e:  # a reader error (a control character, bad encoding)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecFileError(f"{p} is not valid YAML: {first}") from None


def syntax_error(
    p: Path, kind: str, problem: str, text: str, line: int, column: int
) -> SpecFileError:
    """`spec.yaml:3:16: not valid YAML: <problem>`, then the line and a caret under the
    column (line and column 0-based, as the parsers give them)."""
    lines = text.splitlines()
    source = lines[line] if 0 <= line < len(lines) else ""
    column = max(0, min(column, len(source)))
    number = str(line + 1)
    # Tabs kept under tabs, so the caret lines up however the terminal expands them.
    pad = "".join("\t" if c == "\t" else " " for c in source[:column])
    return SpecFileError(
        f"{p}:{line + 1}:{column + 1}: not valid {kind}: {problem}\n"
        f"  {number} | {source}\n"
        f"  {' ' * len(number)} | {pad}^"
    )


def format_warnings(job: Mapping[str, Any]) -> list[str]:
    """`warning: world_size: …` lines for a submit's answer (none when it has no warnings)."""
    return [
        f"warning: {w.get('field', 'spec')}: {w.get('message', '')}"
        for w in job.get("warnings") or []
        if isinstance(w, Mapping)
    ]


def print_warnings(job: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """Print a submit's warnings on stderr: the job was stored all the same, so they never
    change the exit code, and stdout keeps only the job id."""
    out = sys.stderr if file is None else file
    for line in format_warnings(job):
        print(line, file=out, flush=True)
