"""The size of a `torchvision/<name>` model with its `model.args`, counted before the job
is stored: built on PyTorch's meta device (shapes only, nothing allocated), so a spec such
as `resnet50` with `width_per_group: 65536` (~11.9 T parameters) is refused at submit like
an `mlp` of the same size (contracts/datasets.py counts the built-in models without
torch). A bundle's own model cannot be built here: the trainer counts it the same way
before it allocates (trainer/modelguard.py).

torch and torchvision are imported on the first such spec only (the API and the
scheduler start without them), in the request's thread. The build is bounded: at most
`MAX_MODULES` modules and `BUILD_S` seconds of the building thread's CPU time (a loaded
host slows a build without making it cost more; `BUILD_WALL_S` of wall time backs it, for a
build starved of CPU), checked by torch's global registration hooks, active only in the
thread counting, at most `MAX_BUILDS` at once in a process, and its
outcome is cached (an LRU of `CACHE_SIZE`, keyed by the digest of the model section's
canonical JSON with the class count). A caller may bound the builds one request makes
(`bounded`, a `Budget`: the API's, api/admission.py); a cached count costs nothing and is
never charged.

RegNets compute their stage widths from small tensors in their constructor (`.tolist()`),
which the meta device cannot give; a build that fails so is retried with tensors of at
most `SMALL` elements made on the CPU (their size is fixed by the model, not by args).
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torchyard.contracts import datasets
from torchyard.contracts.spec import JobSpec

Problems = list[tuple[str, str]]
MAX_MODULES = 10_000  # torchvision's largest classification model has ~1,400
BUILD_S = 5.0  # CPU seconds of the building thread
BUILD_WALL_S = 4 * BUILD_S
MAX_BUILDS = 2
SMALL = 64  # elements: the largest tensor the RegNet retry makes on the CPU
CACHE_SIZE = 1024  # counted models kept (a digest and a count or a message each)
_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
_DUPLICATE = re.compile(r"multiple values for (?:keyword )?argument '(\w+)'")
_META_DATA = "meta tensor"  # in torch's "Cannot copy out of meta tensor; no data!"


class BuildRefused(Exception):
    """The build went past MAX_MODULES modules or its time (`cacheable`: the
    module bound, which the same args always pass)."""

    def __init__(self, message: str, *, cacheable: bool = False):
        self.cacheable = cacheable
        super().__init__(message)


class TooManyBuilds(Exception):
    """One request needs more distinct models built than its Budget allows."""

    def __init__(self, bound: int):
        self.bound = bound
        super().__init__(f"more than {bound} different torchvision models to build")


class Budget:
    """The builds one request may make: at most `max_builds` distinct models not in the
    cache. `claim` is called before the first one (it raises to refuse: the API's
    per-user slot), so a request whose models are all cached never claims."""

    def __init__(self, max_builds: int, claim: Callable[[], None] | None = None):
        self.max_builds, self.claim = max_builds, claim
        self.charged: set[str] = set()

    def charge(self, key: str) -> None:
        if key in self.charged:  # a refused build, asked again in the same request
            return
        if len(self.charged) >= self.max_builds:
            raise TooManyBuilds(self.max_builds)
        if not self.charged and self.claim is not None:
            self.claim()
        self.charged.add(key)


class _Current(threading.local):
    budget: Budget | None = None


_current = _Current()


@contextlib.contextmanager
def bounded(budget: Budget) -> Iterator[Budget]:
    """Charge this thread's builds to `budget` until the block ends."""
    before, _current.budget = _current.budget, budget
    try:
        yield budget
    finally:
        _current.budget = before


@dataclass(frozen=True)
class _Refusal:
    message: str  # a cached BuildRefused's


class _Lru:
    """Counts by key, the least recently used dropped past `size` (thread-safe)."""

    def __init__(self, size: int):
        self.size, self._items = size, OrderedDict[str, Any]()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_counted = _Lru(CACHE_SIZE)


class _InBuild(threading.local):
    active = False
    modules = 0
    cpu_deadline = 0.0  # time.thread_time()
    deadline = 0.0  # time.monotonic()


_in_build = _InBuild()
_builds = threading.BoundedSemaphore(MAX_BUILDS)
_setup = threading.Lock()
_hooks_installed = False


def torchvision_problems(spec: JobSpec, max_params: int) -> Problems:
    """Why a `torchvision/<name>` model of this spec is refused: an unknown name, args the
    model does not take (named), a build past the bounds, or more parameters than
    `max_params`; [] for other models. The class count is the data's (1 when only the
    job's own data set knows it: the count is then a lower bound)."""
    model = spec.model
    if model is None or model.kind != "torchvision":
        return []
    name = model.name.partition("/")[2]
    classes = datasets.data_classes(spec.data) if spec.data is not None else None
    args = json.dumps(model.args or {}, sort_keys=True)
    try:
        counted = count(name, args, classes or 1)
    except BuildRefused as e:
        return [("model.args", f"torchvision/{name}: {e}")]
    if isinstance(counted, tuple):
        return [counted]
    if counted <= max_params:
        return []
    field = "model.args" if model.args else "model"
    bound = "" if classes else " (at least: the class count is the data set's own)"
    return [
        (field, datasets.too_many_parameters(counted, max_params, f"torchvision/{name}") + bound)
    ]


def count(name: str, args_json: str, classes: int) -> int | tuple[str, str]:
    """The model's parameter count, or the (field, message) of why it cannot be built;
    from the cache, else built (charged to this thread's Budget, if any). A refusal for
    the module bound is cached; one for time is not (a build slowed by load may pass)."""
    tvm = _torchvision()
    known = tvm.list_models(module=tvm)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return "model.name", f"torchvision has no classification model {name!r}{hint}"
    key = hashlib.sha256(json.dumps([name, classes, args_json]).encode()).hexdigest()
    found = _counted.get(key)
    if isinstance(found, _Refusal):
        raise BuildRefused(found.message, cacheable=True)  # a fresh one: no traceback kept
    if found is not None:
        return found
    if _current.budget is not None:
        _current.budget.charge(key)
    try:
        counted = _build_count(tvm, name, classes, json.loads(args_json))
    except BuildRefused as e:
        if e.cacheable:
            _counted.put(key, _Refusal(str(e)))
        raise
    _counted.put(key, counted)
    return counted


def _build_count(tvm: Any, name: str, classes: int, args: dict[str, Any]) -> int | tuple[str, str]:
    with _builds:
        try:
            net = _bounded_build(tvm, name, classes, args)
        except BuildRefused:
            raise
        except Exception as e:  # args the constructor refuses, in whatever way it does
            return _build_problem(name, e)
    return sum(p.numel() for p in net.parameters())


def _bounded_build(tvm: Any, name: str, classes: int, args: dict[str, Any]) -> Any:
    """Build on the meta device within the module and time bounds (the RegNet retry too)."""
    import torch

    _in_build.active, _in_build.modules = True, 0
    _in_build.cpu_deadline = time.thread_time() + BUILD_S
    _in_build.deadline = time.monotonic() + BUILD_WALL_S
    try:
        try:
            with torch.device("meta"):
                return tvm.get_model(name, weights=None, num_classes=classes, **args)
        except NotImplementedError as e:
            if _META_DATA not in str(e):
                raise
        _in_build.modules = 0
        with _small_on_cpu():
            return tvm.get_model(name, weights=None, num_classes=classes, **args)
    finally:
        _in_build.active = False


def _build_problem(name: str, e: Exception) -> tuple[str, str]:
    text = str(e)
    if isinstance(e, TypeError) and (m := _UNEXPECTED.search(text)):
        return f"model.args.{m[1]}", f"torchvision/{name} takes no argument {m[1]!r}"
    if isinstance(e, TypeError) and (m := _DUPLICATE.search(text)):
        return f"model.args.{m[1]}", f"torchvision/{name} sets {m[1]!r} itself"
    detail = f"{type(e).__name__}: {text.strip().partition(chr(10))[0]}"
    if len(detail) > 300:
        detail = detail[:300] + "…"
    return "model.args", f"torchvision/{name} cannot be built with these args: {detail}"


def _on_registration(*_: Any) -> None:
    """torch's global module and parameter registration hook: the bounds of a build in
    this thread (no-op in any other)."""
    b = _in_build
    if not b.active:
        return
    b.modules += 1
    if b.modules > MAX_MODULES:
        raise BuildRefused(
            f"building it with these args makes more than {MAX_MODULES} modules", cacheable=True
        )
    if time.thread_time() > b.cpu_deadline:
        raise BuildRefused(f"building it with these args takes more than {BUILD_S:g} s")
    if time.monotonic() > b.deadline:
        raise BuildRefused(
            f"building it with these args took more than {BUILD_WALL_S:g} s on this host"
        )


def _torchvision() -> Any:
    """torchvision.models, imported (with torch) on first use, the bounds' hooks installed
    once. A process that froze its start-up heap (the API) freezes torch's modules too."""
    global _hooks_installed
    with _setup:
        import torch.nn.modules.module as tmod
        import torchvision.models as tvm

        if not _hooks_installed:
            tmod.register_module_module_registration_hook(_on_registration)
            tmod.register_module_parameter_registration_hook(_on_registration)
            _hooks_installed = True
            if gc.get_freeze_count():
                gc.freeze()
    return tvm


def _small_on_cpu() -> Any:
    """A mode in which tensor constructors make their result on the meta device unless it
    has at most SMALL elements (then on the CPU, with data)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    class SmallOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            if func not in constructors:
                return func(*args, **kwargs)
            kwargs["device"] = "meta"
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel() <= SMALL:
                kwargs["device"] = "cpu"
                out = func(*args, **kwargs)
            return out

    return SmallOnCpu()
