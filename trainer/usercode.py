"""Calling the user's code: `module:function` factories for models and data sets.

The module is imported from the job's code bundle (first on `sys.path`: trainer/cli.py) or
from a package installed on the workers. Whatever goes wrong inside the user's code (an
import error, an exception, a wrong return type) becomes a `UserCodeError`, whose traceback
is printed to the job log: the job fails with an `error` event of kind `user_code` and is
not retried (trainer/failures.py), since running the same code again fails the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchyard.trainer.failures import UserCodeError, add_user_root, keeps_its_kind


def load_factory(name: str) -> Callable[..., Any]:
    """The function a `module:function` name points at."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise UserCodeError(
                f"{name}: no module {e.name!r} in the job's code bundle or the workers' "
                "installed packages"
            ) from e
        raise _failed(f"importing {module_name!r}", e) from e
    except Exception as e:
        raise _failed(f"importing {module_name!r}", e) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserCodeError(f"{name}: module {module_name!r} has no function {attr!r}")
    _note_root(module_name)
    return fn


def _note_root(module_name: str) -> None:
    """The folder of the factory's top-level package (or module), so that an exception
    raised later through its frames is told as the user's (trainer/failures.py). Our own
    packages and torch's are never the user's."""
    top = module_name.partition(".")[0]
    if top in ("torch", "torchvision", "torchyard", "numpy"):
        return
    spec = importlib.util.find_spec(top)
    if spec is None:
        return
    if spec.submodule_search_locations:  # a package: its folder
        for folder in spec.submodule_search_locations:
            add_user_root(Path(folder))
    elif spec.origin and spec.origin not in ("built-in", "frozen"):
        add_user_root(Path(spec.origin))  # a single module file


def call_user(what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """fn(**kwargs); an exception in it is the user's, told as such."""
    try:
        return fn(**kwargs)
    except Exception as e:
        raise _failed(what, e) from e


@contextmanager
def first_pass(model: str, what: str, run_dir: Path) -> Iterator[None]:
    """Around the first `what` (a training step, an evaluation batch) of the user's model
    `model`. A factory may build nothing but torch modules, so no frame of the user's is in
    the traceback; a shape, dtype or device mismatch there is still their model's, and
    fails every attempt the same way. Faults that have a kind of their own keep it."""
    try:
        yield
    except Exception as e:
        if keeps_its_kind(e, run_dir):
            raise
        said = f"model {model} failed in its first {what}: {type(e).__name__}: {e}"
        raise _failed(f"running the first {what} of model {model}", e, said) from e


def _failed(what: str, e: BaseException, message: str | None = None) -> UserCodeError:
    # The user needs their own traceback: into the job log (stderr), once.
    print(f"trainer: user code failed while {what}:", file=sys.stderr)
    traceback.print_exception(e, file=sys.stderr)
    return UserCodeError(message or f"{what}: {type(e).__name__}: {e}")
