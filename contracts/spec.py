"""The v1 job spec: what a user may ask of a training job.

This module imports pydantic only, never torch: the API validates specs with it
without loading torch, and the trainer reads the same models.

`parse_spec(obj)` is the one entry point. Every problem in a spec is reported
at once as a `SpecError` whose `problems` are `(field, message)` pairs, the
field written as a dotted path (`optimizer.lr`, `model.hidden.0`).
The wording of those messages is `contracts/specerrors.py`; the data-set catalogue and
the size estimates the server's limits use are `contracts/datasets.py`.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from torchyard.contracts.specerrors import SpecError, validation_problems, without_excess_unknown
from torchyard.contracts.torchvision_names import CLASSIFIERS

BUILTIN_MODELS = ("mlp", "lenet", "resnet18")
BUILTIN_DATA = ("digits", "mnist", "fashion_mnist", "cifar10", "synthetic")
OptimizerName = Literal["sgd", "adam", "adamw"]
ScheduleName = Literal["constant", "cosine", "onecycle"]
Precision = Literal["auto", "fp32", "fp16", "bf16"]

# Models that take [channels, height, width] images.
CONV_MODELS = frozenset({"lenet", "resnet18"})
# Default learning rate per optimizer when the spec gives none.
DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-3}

PositiveInt = Annotated[int, Field(gt=0)]

# `module:function`: a factory in the job's code bundle or in a package installed on the
# workers. Dotted identifiers only (never a path); our own namespace cannot be named.
FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
TORCHVISION_RE = re.compile(r"^torchvision/[a-z][a-z0-9_]*$")
# `imagefolder/<dir>`: one name under the data root, never a path (no `/`, no `..`).
IMAGEFOLDER_RE = re.compile(r"^imagefolder/[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
# An entrypoint script: a relative path inside the bundle, ending in .py.
SCRIPT_RE = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_.-]*/)*[A-Za-z0-9_][A-Za-z0-9_.-]*\.py$")
BUNDLE_ID_RE = r"^[0-9a-f]{64}$"
JOB_ID_RE = r"^[0-9a-f]{32}$"
# A project: a team's name, or `~<user>` for a user's personal project.
PROJECT_RE = r"^(~.{1,100}|[A-Za-z0-9][A-Za-z0-9._-]{0,99})$"
TAG_RE = r"^[A-Za-z0-9_.:/=+-]{1,64}$"
MAX_TAGS = 32
MAX_NOTES = 10_000
MAX_ARGS_JSON = 65_536  # model.args / data.args, as JSON
# `params`: a job's named values (`torchyard.job.params()`, the jobs table's columns, the
# list's `?param=` filter, a sweep's `params.<name>`). A name is an identifier, so that
# `params.<name>` is one dotted spec path and `?param=<name>:<value>` splits at its colon.
PARAM_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
PARAM_NAME_RULE = "a parameter's name is a letter or '_', then up to 63 letters, digits or '_'"
MAX_PARAMS = 64
MAX_PARAM_STR = 1024
_PARAM_INT = 2**63  # ints in (-2**63, 2**63)


def is_factory(name: str) -> bool:
    return FACTORY_RE.fullmatch(name) is not None


def _name_problem(name: str, kind: str, builtin: tuple[str, ...], other: str) -> str | None:
    """What is wrong with a model or data set name of `kind`, or None. `other` is how the
    non-factory form besides the built-ins is written, e.g. 'torchvision/<name>'."""
    if kind == "builtin":
        if name in builtin:
            return None
        hint = ""
        if other.startswith("torchvision/") and name in CLASSIFIERS:
            hint = f"; did you mean 'torchvision/{name}'?"
        elif close := difflib.get_close_matches(name, builtin, n=1, cutoff=0.75):
            hint = f"; did you mean '{close[0]}'?"
        return (
            f"must be one of {', '.join(map(repr, builtin))}, '{other}' or 'module:function'" + hint
        )
    if kind == "factory":
        if not is_factory(name):
            return "must be 'module:function' (dotted module, one colon)"
        if name.split(".")[0].split(":")[0] == "torchyard":
            return "torchyard's own modules cannot be named"
        return None
    pattern = TORCHVISION_RE if kind == "torchvision" else IMAGEFOLDER_RE
    if pattern.fullmatch(name):
        return None
    if kind == "torchvision":
        return "must be 'torchvision/<name>' with a lowercase model name"
    return "must be 'imagefolder/<dir>' with <dir> one name under the data root"


def param_value_problem(value: Any) -> str | None:
    """What is wrong with one `params` value, or None: a string (at most MAX_PARAM_STR
    characters), an int (64-bit), a finite float or a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -_PARAM_INT < value < _PARAM_INT else "must be a 64-bit integer"
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number"
    if isinstance(value, str):
        if len(value) > MAX_PARAM_STR:
            return f"must be at most {MAX_PARAM_STR} characters"
        return None
    return f"must be a string, a number or a boolean, not {_kind(value)}"


def params_problems(params: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of a spec's `params`, each as (`<name>`, message); [] when it is fine."""
    if len(params) > MAX_PARAMS:
        return [("", f"at most {MAX_PARAMS} parameters, got {len(params)}")]
    problems = []
    for name, value in params.items():
        shown = name[:64] + ("…" if len(name) > 64 else "")
        if not PARAM_NAME_RE.fullmatch(name):
            problems.append((shown, PARAM_NAME_RULE))
        elif problem := param_value_problem(value):
            problems.append((name, problem))
    return problems


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    return "a list" if isinstance(value, list) else type(value).__name__


def _args_problems(args: dict[str, Any] | None, kind: str, what: str) -> list[tuple[str, str]]:
    if args is None:
        return []
    if kind == "builtin":
        return [("args", f"only applies to 'module:function'{what} names")]
    try:
        size = len(json.dumps(args))
    except (TypeError, ValueError):
        return [("args", "must hold JSON values only")]
    if size > MAX_ARGS_JSON:
        return [("args", f"must be at most {MAX_ARGS_JSON} bytes as JSON")]
    return []


class _Strict(BaseModel):
    # Unknown fields are errors; no silent coercion of "128" into 128 or 1 into True;
    # NaN and infinity (which Python's json accepts) are refused everywhere.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _problems(problems: list[tuple[str, str]]) -> None:
    """Raise all cross-field problems of one section together."""
    if problems:
        raise PydanticCustomError(
            "spec_problems", "; ".join(m for _, m in problems), {"problems": problems}
        )


class ModelSpec(_Strict):
    name: str = Field(min_length=1, max_length=200)
    """Built in: `mlp`, `lenet` (conv 6-16, fc 120-84) or `resnet18` (small-image stem);
    `torchvision/<name>`: any torchvision classification model (random init); or
    `module:function`: your factory, called as `function(in_shape=..., num_classes=...,
    **args)` and returning an `nn.Module`."""
    hidden: list[PositiveInt] | None = Field(default=None, max_length=16)
    """Hidden layer widths of the `mlp` (default [128]); not allowed for other models."""
    args: dict[str, Any] | None = None
    """Keyword arguments for a `torchvision/<name>` model or a `module:function` factory."""

    @property
    def kind(self) -> Literal["builtin", "torchvision", "factory"]:
        if self.name.startswith("torchvision/"):
            return "torchvision"
        return "factory" if ":" in self.name else "builtin"

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        problems = []
        kind = self.kind
        if problem := _name_problem(self.name, kind, BUILTIN_MODELS, "torchvision/<name>"):
            problems.append(("name", problem))
        problems += _args_problems(self.args, kind, "/'torchvision/<name>'")
        if self.hidden is not None and self.name != "mlp" and not problems:
            problems.append(("hidden", f"only applies to model 'mlp', not '{self.name}'"))
        if self.hidden is not None and any(h > 65536 for h in self.hidden):
            problems.append(("hidden", "each width must be <= 65536"))
        _problems(problems)
        return self

    @property
    def hidden_sizes(self) -> list[int]:
        return list(self.hidden) if self.hidden is not None else [128]


class DataSpec(_Strict):
    name: str = Field(min_length=1, max_length=212)
    """`digits` (bundled with scikit-learn), `mnist`, `fashion_mnist`, `cifar10` (read from
    the server's data root), `synthetic` (deterministic, learnable, any shape),
    `imagefolder/<dir>` (`<data root>/<dir>/{train,val}/<class>/*` images), or
    `module:function`: your factory, called as `function(root=<data root>, **args)` and
    returning `(train_dataset, val_dataset, num_classes)`."""
    args: dict[str, Any] | None = None
    """`module:function` only: keyword arguments for the factory."""
    image_size: int | None = Field(default=None, ge=8, le=4096)
    """`imagefolder/<dir>` only: side of the square crop the model sees (default 224)."""
    val_fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Share of the training set held out for validation when the set has no test split."""
    shape: list[PositiveInt] | None = Field(default=None, min_length=1, max_length=3)
    """`synthetic` only: sample shape, e.g. [1, 28, 28] (default) or [3, 32, 32]."""
    num_classes: int | None = Field(default=None, ge=2, le=100_000)
    """`synthetic` only: number of classes (default 10)."""
    size: int | None = Field(default=None, ge=2, le=10_000_000)
    """`synthetic` only: number of samples (default 60000)."""
    loader: Literal["auto", "device", "dataloader"] = "auto"
    """`device`: whole set as tensors on the device; `dataloader`: torch DataLoader with
    workers; `auto`: device when it fits in a quarter of device memory."""
    num_workers: int = Field(default=2, ge=0, le=64)
    """DataLoader worker processes (only with the `dataloader` path)."""

    @property
    def kind(self) -> Literal["builtin", "imagefolder", "factory"]:
        if self.name.startswith("imagefolder/"):
            return "imagefolder"
        return "factory" if ":" in self.name else "builtin"

    @property
    def folder(self) -> str:
        """`imagefolder/<dir>`: the `<dir>`."""
        return self.name.partition("/")[2]

    @property
    def crop(self) -> int:
        return self.image_size if self.image_size is not None else 224

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        problems = []
        kind = self.kind
        if problem := _name_problem(self.name, kind, BUILTIN_DATA, "imagefolder/<dir>"):
            problems.append(("name", problem))
        problems += _args_problems(self.args if kind != "imagefolder" else None, kind, "")
        if self.args is not None and kind == "imagefolder":
            problems.append(("args", "only applies to 'module:function' names"))
        if self.image_size is not None and kind != "imagefolder":
            problems.append(("image_size", "only applies to 'imagefolder/<dir>'"))
        if kind != "builtin" and self.loader == "device":
            problems.append(("loader", f"'device' needs a built-in data set, not '{self.name}'"))
        if self.name != "synthetic":
            for f in ("shape", "num_classes", "size"):
                if getattr(self, f) is not None:
                    problems.append((f, f"only applies to data 'synthetic', not '{self.name}'"))
        elif self.shape is not None and self.numel > 16_777_216:
            problems.append(("shape", "a sample may hold at most 16777216 values"))
        _problems(problems)
        return self

    @property
    def sample_shape(self) -> list[int]:
        return list(self.shape) if self.shape is not None else [1, 28, 28]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.sample_shape:
            n *= d
        return n

    @property
    def classes(self) -> int:
        return self.num_classes if self.num_classes is not None else 10

    @property
    def samples(self) -> int:
        return self.size if self.size is not None else 60_000


class OptimizerSpec(_Strict):
    name: OptimizerName
    lr: float | None = Field(default=None, gt=0.0, le=10.0)
    """Peak learning rate (default 0.01 for sgd, 0.001 for adam/adamw)."""
    momentum: float | None = Field(default=None, ge=0.0, lt=1.0)
    """`sgd` only (default 0.9)."""
    nesterov: bool = False
    """`sgd` only."""
    betas: list[Annotated[float, Field(ge=0.0, lt=1.0)]] | None = Field(
        default=None, min_length=2, max_length=2
    )
    """`adam`/`adamw` only (default [0.9, 0.999])."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> OptimizerSpec:
        problems = []
        if self.name != "sgd":
            if self.momentum is not None:
                problems.append(("momentum", f"only applies to 'sgd', not '{self.name}'"))
            if self.nesterov:
                problems.append(("nesterov", f"only applies to 'sgd', not '{self.name}'"))
        elif self.betas is not None:
            problems.append(("betas", "only applies to 'adam' and 'adamw', not 'sgd'"))
        if self.name == "sgd" and self.nesterov and self.momentum == 0.0:
            problems.append(("nesterov", "needs momentum > 0"))
        _problems(problems)
        return self

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.name]

    @property
    def sgd_momentum(self) -> float:
        return self.momentum if self.momentum is not None else 0.9

    @property
    def adam_betas(self) -> tuple[float, float]:
        b = self.betas if self.betas is not None else [0.9, 0.999]
        return (b[0], b[1])


class ScheduleSpec(_Strict):
    name: ScheduleName = "constant"
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000)
    """Linear warm-up from 0 to the peak lr over this many optimizer steps."""
    min_lr_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """`cosine`: final lr as a fraction of the peak."""


class CheckpointSpec(_Strict):
    every_epochs: int | None = Field(default=1, ge=1)
    """Save at the end of every N epochs (null: never by epoch)."""
    every_steps: int | None = Field(default=None, ge=1)
    """Save every N optimizer steps (null: never by step)."""
    keep_last: int = Field(default=3, ge=1, le=1000)
    """Resume checkpoints kept on disk; older ones are deleted."""


class CodeSpec(_Strict):
    bundle: str = Field(pattern=BUNDLE_ID_RE)
    """Id (sha256) of a code bundle you uploaded (POST /v1/bundles, or `submit --code DIR`)."""


class InitSpec(_Strict):
    from_job: str = Field(pattern=JOB_ID_RE)
    """Another job of yours whose weights start this one (not its optimizer)."""
    checkpoint: Literal["latest", "weights"] | Annotated[int, Field(ge=0)] = "latest"
    """`latest`: its final weights when it finished, else its newest resume checkpoint;
    `weights`: its final weights only; a number: its resume checkpoint of that step."""


class EntrypointSpec(_Strict):
    script: str = Field(min_length=4, max_length=500)
    """A Python file in the bundle, relative to its top (`train.py`, `scripts/train.py`)."""
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default=[], max_length=1000)
    """Its command-line arguments (`sys.argv[1:]`)."""

    @model_validator(mode="after")
    def _check(self) -> EntrypointSpec:
        if not SCRIPT_RE.fullmatch(self.script):
            _problems([("script", "must be a relative path to a .py file inside the bundle")])
        return self


# What a script job may set besides its entrypoint: the rest configures torchyard's loop.
SCRIPT_FIELDS = frozenset(
    {
        "name",
        "code",
        "entrypoint",
        "world_size",
        "seed",
        "checkpoint",
        "max_restarts",
        "priority",
        "preemptible",
        "project",
        "tags",
        "notes",
        "params",
    }
)


def batch_split_problem(batch_size: int, world_size: int) -> str | None:
    """Why a global batch cannot be split evenly over `world_size` ranks, or None. The one rule:
    the spec's own check, the trainer's command line (the world torchrun gives) and the
    training loop all ask it."""
    if batch_size % world_size:
        return f"must be divisible by world_size ({world_size})"
    return None


class JobSpec(_Strict):
    """A training job: `model`, `data` and `optimizer` for torchyard's loop, or `entrypoint`
    and `code` for your own script."""

    name: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[\w.\- ]+$")
    """Display name (default: `<data>-<model>`, or the script's name)."""
    project: str | None = Field(default=None, pattern=PROJECT_RE)
    """The project the job belongs to (default: your personal project `~<you>`); you need
    the role member or owner in it."""
    tags: list[Annotated[str, Field(pattern=TAG_RE)]] | None = Field(
        default=None, max_length=MAX_TAGS
    )
    """Labels to filter by (GET /v1/jobs?tag=); kept on the job, changed by PATCH."""
    notes: str | None = Field(default=None, max_length=MAX_NOTES)
    """A free note kept on the job, changed by PATCH."""
    params: dict[str, Any] | None = None
    """Named values of the run (`{"lr": 0.1, "arch": "wide"}`): a script reads them with
    `torchyard.job.params()`; every job shows them (the jobs table's columns) and the list
    filters by them (`GET /v1/jobs?param=lr:0.1`); a sweep sets one as `params.<name>`.
    At most 64; a name is an identifier (up to 64 characters), a value a string (up to 1024
    characters), a number or a boolean. A built-in job only records them."""
    model: ModelSpec | None = None
    data: DataSpec | None = None
    optimizer: OptimizerSpec | None = None
    code: CodeSpec | None = None
    """Your code bundle: first on the trainer's `sys.path`, its working directory."""
    entrypoint: EntrypointSpec | None = None
    """Run this script of the bundle (under torchrun, one rank per worker) instead of
    torchyard's loop; it talks to torchyard through `torchyard.job`."""
    init: InitSpec | None = None
    """Start the model's weights from another job's."""
    schedule: ScheduleSpec = ScheduleSpec()
    batch_size: int = Field(default=128, ge=1, le=1_048_576)
    """Global batch: with world_size N each rank takes batch_size / N."""
    epochs: int = Field(default=5, ge=1, le=100_000)
    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps even if epochs remain."""
    precision: Precision = "auto"
    world_size: int = Field(default=1, ge=1, le=1024)
    """GPUs (workers) the job needs; > 1 runs DDP, gang-scheduled."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval_every_epochs: int = Field(default=1, ge=0)
    """Evaluate every N epochs (0: only at the end)."""
    log_every_steps: int = Field(default=10, ge=1)
    """Emit the running train/loss every N optimizer steps."""
    grad_clip: float | None = Field(default=None, gt=0.0)
    """Clip the global gradient norm to this value."""
    channels_last: bool = False
    """Use channels_last memory format for image models (a GPU speed-up)."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    deterministic: bool = False
    """Deterministic kernels only, no cuDNN autotuning and no TF32: GPU runs and their
    resumes repeat bit for bit, at some cost in speed (CPU runs always do)."""
    max_restarts: int = Field(default=2, ge=0, le=100)
    """Lost attempts retried (resuming from the latest checkpoint) before the job fails."""
    priority: int = Field(default=0, ge=-1000, le=1000)
    """Higher runs first; among equal priorities users take turns by fair share, then the
    oldest job goes first. A queued job preempts preemptible jobs of lower priority (another
    user's only above that user's max_priority). At most your max_priority (default 0, set by
    an admin with the quota)."""
    preemptible: bool = True
    """Whether a higher-priority job may stop this one (it checkpoints on SIGTERM and
    resumes, bit for bit, when workers are free). Only admins may give a job that is not
    preemptible a priority above 0."""

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: dict[str, Any] | None) -> dict[str, Any] | None:
        if params is not None:
            problems = params_problems(params)
            if problems and problems[0][0] == "":  # the count: the field itself
                raise PydanticCustomError("params_count", problems[0][1])
            _problems(problems)
        return params

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        problems = self._script_problems() if self.entrypoint else self._loop_problems()
        _problems(problems)
        return self

    def _script_problems(self) -> list[tuple[str, str]]:
        problems = [
            (f, "not allowed with 'entrypoint' (the script builds its own)")
            for f in sorted(self.model_fields_set - SCRIPT_FIELDS)
        ]
        if self.code is None:
            problems.append(("code", "required with 'entrypoint': the bundle holding the script"))
        return problems

    def _loop_problems(self) -> list[tuple[str, str]]:
        missing = [("model", self.model), ("data", self.data), ("optimizer", self.optimizer)]
        problems = [(f, "required (or give 'entrypoint' and 'code')") for f, v in missing if not v]
        if problems or self.model is None or self.data is None:
            return problems
        if problem := batch_split_problem(self.batch_size, self.world_size):
            problems.append(("batch_size", problem))
        shape = self.data.sample_shape
        if self.model.name in CONV_MODELS and self.data.name == "synthetic":
            if len(shape) != 3:
                problems.append(
                    ("data.shape", f"model '{self.model.name}' needs [channels, height, width]")
                )
            elif min(shape[1:]) < 4:
                problems.append(
                    ("data.shape", f"model '{self.model.name}' needs height, width >= 4")
                )
        return problems

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.entrypoint is not None:
            return self.entrypoint.script.rsplit("/", 1)[-1].removesuffix(".py")
        assert self.model is not None and self.data is not None
        return f"{self.data.name.replace('/', '-').replace(':', '.')}-{self.model.name.replace('/', '-').replace(':', '.')}"

    @property
    def runs_code(self) -> bool:
        """Whether the job runs code named by the user (a bundle, a script, a factory): a
        permission (`torchyard token create --can-run-code`)."""
        factories = [
            s.name for s in (self.model, self.data) if s is not None and s.kind == "factory"
        ]
        return self.code is not None or self.entrypoint is not None or bool(factories)


def parse_spec(obj: Any) -> JobSpec:
    """Validate a decoded JSON/YAML object as a JobSpec, or raise SpecError listing every problem."""
    if not isinstance(obj, dict):
        raise SpecError([("spec", "must be a JSON object")])
    bounded, dropped = without_excess_unknown(JobSpec, obj)
    try:
        return JobSpec.model_validate(bounded)
    except ValidationError as e:
        # The spec's own check (missing sections) runs only when every field is valid:
        # say what is missing together with the field errors.
        problems: list[tuple[str, str]] = []
        if obj.get("entrypoint") is None:
            problems += [
                (f, "required (or give 'entrypoint' and 'code')")
                for f in ("model", "data", "optimizer")
                if obj.get(f) is None
            ]
        problems += validation_problems(JobSpec, e, dropped)
        raise SpecError(list(dict.fromkeys(problems))) from None


# Fields that are left out of a spec's dict when unset (null), so that a built-in job's
# stored spec reads as it did before they existed.
_OMIT_WHEN_NULL = {
    "project",
    "tags",
    "notes",
    "params",
    "args",
    "image_size",
    "code",
    "entrypoint",
    "init",
    "model",
    "data",
    "optimizer",
}


def _drop_nulls(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (v is None and k in _OMIT_WHEN_NULL)}


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """The spec as plain JSON types, with every default written out (a script job: only
    the fields that apply to it)."""
    d = spec.model_dump(mode="json")
    if spec.entrypoint is not None:
        return {k: v for k, v in d.items() if k in SCRIPT_FIELDS}
    for part in ("model", "data"):
        d[part] = _drop_nulls(d[part])
    return _drop_nulls(d)
