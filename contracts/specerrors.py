"""How a spec's problems are worded: `SpecError` (every problem at once, as `(field,
message)` pairs with dotted field paths) and the messages that help fix each one (the value
received for a value of the wrong kind, the field meant for an unknown one).

The work is bounded whatever the spec holds (a 1 MB body can carry 50,000 unknown fields):
at most MAX_LISTED problems are worded one by one (the did-you-mean search is the costly
part), the rest are counted in one last problem ("and N more").

Torch-free, pydantic only; `contracts/spec.py` raises these for its models."""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

# Problems worded one by one (each unknown field with its did-you-mean); the rest are
# summed up in one more problem, so a hostile spec costs a bounded amount of work.
MAX_LISTED = 20


class SpecError(ValueError):
    """A spec with one or more problems; `problems` lists `(field, message)` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


_FIXED = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "string_too_short": "must not be empty",
    "finite_number": "must be a finite number",
}
"""Messages of pydantic error types that say the same whatever the field."""


def _friendly(err: Mapping[str, Any]) -> str:
    t, ctx = err["type"], err.get("ctx") or {}
    if t in _FIXED:
        return _FIXED[t]
    match t:
        case "greater_than":
            return f"must be > {ctx['gt']}"
        case "greater_than_equal":
            return f"must be >= {ctx['ge']}"
        case "less_than":
            return f"must be < {ctx['lt']}"
        case "less_than_equal":
            return f"must be <= {ctx['le']}"
        case "literal_error":
            return f"must be one of {ctx['expected']}"
        case "too_short":
            return f"must have at least {ctx.get('min_length')} item(s)"
        case "too_long":
            return f"must have at most {ctx.get('max_length')} item(s)"
        case "string_too_long":
            return f"must be at most {ctx.get('max_length')} characters"
        case "string_pattern_mismatch" if tuple(err["loc"]) == ("name",):
            return "may hold only letters, digits, spaces, '.', '_' and '-'"
        case "string_pattern_mismatch":
            return f"must match {ctx.get('pattern')}"
    return str(err["msg"])


# Errors about the kind of value given (a string where a number belongs, "fp8" for a
# precision): their message shows the value received, since a YAML or JSON value's type
# is not always what its author thinks (`1e-3` is a string in YAML 1.1, `"5"` in JSON).
_SHOW_RECEIVED = frozenset(
    {
        "int_type", "int_parsing", "int_from_float", "float_type", "float_parsing",
        "bool_type", "bool_parsing", "string_type", "list_type", "model_type",
        "model_attributes_type", "dict_type", "literal_error",
    }
)  # fmt: skip
_RECEIVED_MAX = 60  # characters of a received value shown


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list | tuple) else "an object"


def received(value: Any) -> str:
    """`got "1e-3" (a string)`: the value as JSON (cut short), and its JSON type."""
    if value is None:
        return "got null"
    try:
        shown = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        shown = repr(value)
    if len(shown) > _RECEIVED_MAX:
        shown = shown[: _RECEIVED_MAX - 1] + "…"
    return f"got {shown} ({_json_type(value)})"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The spec section a field holds, also through `X | None`."""
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _section(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The spec section (JobSpec, ModelSpec, …) at a path below `root`, or None."""
    model: type[BaseModel] | None = root
    for part in loc:
        field = model.model_fields.get(part) if model is not None else None
        model = _submodel(field.annotation) if field is not None else None
    return model


@functools.cache
def _sections(model: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """Every section's path -> its field names, from `model` down (the models are fixed:
    computed once per model; callers must not change the answer)."""
    out = {prefix: list(model.model_fields)}
    for name, f in model.model_fields.items():
        if (sub := _submodel(f.annotation)) is not None:
            out |= _sections(sub, f"{prefix}{name}.")
    return out


def did_you_mean(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """For an unknown field: the closest field of its section (`hiden` -> `hidden`), or the
    section where a field of that name lives (`lr` at the top -> `optimizer.lr`); else ''."""
    *parent, name = loc
    section = _section(root, tuple(parent))
    if section is None or not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(section.model_fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    prefix = "".join(f"{p}." for p in parent)
    elsewhere = [
        f"{path}{name}"
        for path, names in _sections(root).items()
        if name in names and path != prefix
    ]
    return f"did you mean '{elsewhere[0]}'?" if elsewhere else ""


def _message(root: type[BaseModel], err: Mapping[str, Any]) -> str:
    """The message of one pydantic error, with what helps fix it: the value received for
    a value of the wrong kind, the field meant for an unknown one."""
    message = _friendly(err)
    if err["type"] in _SHOW_RECEIVED and "input" in err:
        return f"{message}, {received(err['input'])}"
    if err["type"] == "extra_forbidden" and (hint := did_you_mean(root, tuple(err["loc"]))):
        return f"{message} ({hint})"
    return message


def _path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "spec"


def _field_loc(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The error's location without pydantic's union-member tags (`init.checkpoint`, not
    `init.checkpoint.constrained-int`): names below a field that holds no section."""
    out: list[Any] = []
    model: type[BaseModel] | None = root
    leaf = False
    for part in loc:
        if leaf and isinstance(part, str):
            continue
        out.append(part)
        field = model.model_fields.get(part) if model is not None else None
        model = _submodel(field.annotation) if field is not None else None
        leaf = field is not None and model is None
    return tuple(out)


def without_excess_unknown(root: type[BaseModel], obj: Any) -> tuple[Any, int]:
    """`obj` with the unknown fields of each section past its first MAX_LISTED + 1 left
    out, and how many were left out. pydantic builds every error of a validation in one
    call that holds the GIL (50,000 unknown fields: ~0.1 s in which no other thread of the
    API, its event loop included, runs); this Python pass bounds that call. The kept ones
    still fail the validation, so `validation_problems(..., dropped=n)` counts the rest."""
    if not isinstance(obj, dict):
        return obj, 0
    known = root.model_fields
    out: dict[Any, Any] = {}
    unknown = dropped = 0
    for key, value in obj.items():
        field = known.get(key) if isinstance(key, str) else None
        if field is not None:
            sub = _submodel(field.annotation)
            if sub is not None:
                value, n = without_excess_unknown(sub, value)
                dropped += n
            out[key] = value
        elif unknown < MAX_LISTED + 3:
            unknown += 1
            out[key] = value
        else:
            dropped += 1
    return (obj if not dropped else out), dropped


def validation_problems(
    root: type[BaseModel], e: ValidationError, dropped: int = 0
) -> list[tuple[str, str]]:
    """Every error of a failed `root.model_validate` as `(field, message)` pairs; problems
    a model's own check raised as `spec_problems` are listed one by one. Past MAX_LISTED,
    the rest are counted, not worded: one last pair says how many more there are.
    `dropped`: unknown fields `without_excess_unknown` left out before the validation."""
    problems: list[tuple[str, str]] = []
    errors = e.errors(include_url=False, include_context=True, include_input=True)
    for n, err in enumerate(errors):
        if len(problems) >= MAX_LISTED:
            return [*problems, _more(root, errors[n:], dropped)]
        loc = _field_loc(root, tuple(err["loc"]))
        if err["type"] == "spec_problems":
            problems += [(_path((*loc, f)), m) for f, m in err["ctx"]["problems"]]
        else:
            problems.append((_path(loc), _message(root, err)))
    if dropped:
        problems.append(("spec", f"and {dropped} more unknown fields"))
    return problems


def _more(root: type[BaseModel], rest: list[Any], dropped: int = 0) -> tuple[str, str]:
    """The problems not worded, as one: how many, and the first few fields named."""
    named = [_path(_field_loc(root, tuple(err["loc"]))) for err in rest[:3]]
    unknown = sum(1 for err in rest if err["type"] == "extra_forbidden") + dropped
    total = len(rest) + dropped
    what = "unknown fields" if unknown == total else "problems"
    shown = ", ".join(named) + (", …" if total > len(named) else "")
    return "spec", f"and {total} more {what} ({shown})"
