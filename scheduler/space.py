"""A sweep's search space: its parameters (`float`, `int`, `categorical`), each named by the
dotted path of the job spec field it sets (`optimizer.lr`, `model.hidden`), as pydantic
models; the values a create-time check tries (each bound, each choice); setting sampled
values into a copy of a spec; and the space in Optuna's terms (distributions, the grid).

Pure: the API checks a space with it, the controller (scheduler/sweeps.py) samples with it.
Optuna is imported only by the functions that build its objects.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
MAX_PARAMS = 32
MAX_CHOICES = 100
MAX_GRID = 100_000
Problems = list[tuple[str, str]]


class _Param(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FloatParam(_Param):
    type: Literal["float"]
    low: FiniteFloat
    high: FiniteFloat
    log: bool = False
    step: FiniteFloat | None = Field(default=None, gt=0)


class IntParam(_Param):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(default=1, ge=1)


class CategoricalParam(_Param):
    type: Literal["categorical"]
    choices: list[Any] = Field(min_length=1, max_length=MAX_CHOICES)


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]
Space = dict[str, Param]


def _bounds_problems(p: FloatParam | IntParam) -> Problems:
    problems: Problems = []
    if p.low > p.high:
        problems.append(("high", f"must be >= low ({p.low})"))
    if p.log and p.low <= 0:
        problems.append(("low", "must be > 0 with log: true"))
    if p.log and (p.step is not None if isinstance(p, FloatParam) else p.step != 1):
        problems.append(("step", "cannot be used with log: true"))
    return problems


def _choice_key(choice: Any) -> Any:
    """What Optuna stores for a choice: the value itself when it is a plain scalar, else its
    JSON text (Optuna's categorical choices must be None, bool, int, float or str)."""
    if choice is None or isinstance(choice, bool | int | float | str):
        return choice
    return json.dumps(choice, sort_keys=True, separators=(",", ":"))


def param_problems(path: str, p: FloatParam | IntParam | CategoricalParam) -> Problems:
    """Problems of one parameter on its own, as (field under `path`, message) pairs."""
    if not PATH_RE.fullmatch(path):
        return [("", "must be a dotted path of spec fields, e.g. optimizer.lr")]
    if isinstance(p, CategoricalParam):
        keys = [_choice_key(c) for c in p.choices]
        if len(set(map(repr, keys))) != len(keys):
            return [("choices", "must be distinct")]
        if any(isinstance(c, float) and not math.isfinite(c) for c in p.choices):
            return [("choices", "must be finite numbers")]
        return []
    return _bounds_problems(p)


def corners(p: FloatParam | IntParam | CategoricalParam) -> list[tuple[str, Any]]:
    """The values a create-time check builds a spec with, each with its field: both bounds
    (an int's highest value on its step, which Optuna samples up to), or every choice."""
    if isinstance(p, CategoricalParam):
        return [(f"choices.{i}", c) for i, c in enumerate(p.choices)]
    if isinstance(p, IntParam):
        return [("low", p.low), ("high", _int_top(p))]
    return [("low", p.low), ("high", p.high)]


def _int_top(p: IntParam) -> int:
    """The highest value an int parameter takes: high, or the last step below it."""
    return p.low + max(p.high - p.low, 0) // p.step * p.step


class PathError(ValueError):
    """A dotted path that crosses a spec field which is not an object."""


def set_path(spec: dict[str, Any], path: str, value: Any) -> None:
    """Set `path` (dotted) in `spec`, making the objects on the way that are missing."""
    *parents, leaf = path.split(".")
    node = spec
    for i, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise PathError(f"{where} is not an object in the spec, so {path} cannot be set")
        node = child
    node[leaf] = value


def with_params(spec: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `spec` with each of `params` (dotted path -> value) set."""
    out = copy.deepcopy(dict(spec))
    for path, value in params.items():
        set_path(out, path, copy.deepcopy(value))
    return out


# --- in Optuna's terms --------------------------------------------------------------------------


def distributions(space: Space) -> dict[str, BaseDistribution]:
    """Each parameter as an Optuna distribution (categorical choices by `_choice_key`)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, BaseDistribution] = {}
    for name, p in space.items():
        if isinstance(p, FloatParam):
            out[name] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            out[name] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            out[name] = CategoricalDistribution([_choice_key(c) for c in p.choices])
    return out


def decode(space: Space, params: Mapping[str, Any]) -> dict[str, Any]:
    """Optuna's sampled values as spec values: a categorical's original choice (a list
    stays a list), ints as ints."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        p = space[name]
        if isinstance(p, CategoricalParam):
            keys = [_choice_key(c) for c in p.choices]
            out[name] = copy.deepcopy(p.choices[keys.index(value)])
        elif isinstance(p, IntParam):
            out[name] = int(value)
        else:
            out[name] = float(value)
    return out


def grid(space: Space) -> dict[str, list[Any]]:
    """The grid GridSampler walks: every choice, every int from low to high by step."""
    out: dict[str, list[Any]] = {}
    for name, p in space.items():
        if isinstance(p, CategoricalParam):
            out[name] = [_choice_key(c) for c in p.choices]
        elif isinstance(p, IntParam):
            out[name] = list(range(p.low, p.high + 1, p.step))
        else:
            raise ValueError(f"{name}: a float parameter has no grid")
    return out


def grid_problems(space: Space) -> Problems:
    """Why `sampler: grid` cannot walk this space ([] when it can), field by field."""
    problems: Problems = []
    for name, p in space.items():
        if isinstance(p, FloatParam):
            problems.append((name, "sampler grid needs categorical or int parameters"))
        elif isinstance(p, IntParam) and p.log:
            problems.append((f"{name}.log", "sampler grid walks ints by step, not log"))
    return problems


def grid_size(space: Space) -> int:
    """How many points the grid has (capped just above MAX_GRID: only the cap matters)."""
    n = 1
    for p in space.values():
        if isinstance(p, CategoricalParam):
            n *= len(p.choices)
        elif isinstance(p, IntParam):
            n *= (p.high - p.low) // p.step + 1
        n = min(n, MAX_GRID + 1)
    return n


def values_at(space: Mapping[str, Param], base: Any, path: str, default: Any) -> list[Any]:
    """The values a trial's spec can hold at `path` (a top-level field such as `priority`),
    enough to find its extremes: the parameter's bounds (an int's highest value on its step)
    or choices when the space sets it, else the base spec's value, else `default`."""
    p = space.get(path)
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        return [p.low, _int_top(p)]
    if isinstance(p, FloatParam):
        return [p.low, p.high]
    return [base.get(path, default) if isinstance(base, dict) else default]


def iter_corner_params(space: Space) -> Iterator[tuple[str, str, Any]]:
    """(path, field, value) for each value a create-time check tries."""
    for path, p in space.items():
        for field, value in corners(p):
            yield path, field, value
