"""Thread lanes for requests whose cost is bounded but not small, apart from the default
thread pool that serves every other read (TORCHYARD_API_THREADS, often 2): a sweep's model
builds, a log search or a page of 1,000 series never leave another user's GET waiting for
a thread.

- `checks`: job and sweep submits (scheduler/modelsize.py builds a `torchvision/<name>`
  model to count it), TORCHYARD_API_CHECK_THREADS; each submit runs under a Budget of
  TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST builds (422 past it) and claims one of its user's
  TORCHYARD_MAX_MODEL_CHECKS_PER_USER slots at its first build (429 when none is free).
- `costly_reads`: log searches and metrics pages, TORCHYARD_API_COSTLY_READ_THREADS.

Each lane sheds like the default pool (middleware.ShedLoad): past SHED_WAITING_PER_THREAD
requests waiting per thread, a new one gets 503 at once."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request

from torchyard.api.errors import ApiError, validation_error
from torchyard.scheduler import modelsize
from torchyard.settings import Settings

T = TypeVar("T")
LaneName = Literal["checks", "costly_reads"]
SHED_WAITING_PER_THREAD = 64
RETRY_AFTER_S = 5


class Lane:
    """A small limiter of its own threads."""

    def __init__(self, threads: int):
        self.limiter = anyio.CapacityLimiter(threads)
        self.max_waiting = SHED_WAITING_PER_THREAD * threads

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.limiter.statistics().tasks_waiting >= self.max_waiting:
            raise ApiError(503, "the server is busy; retry shortly", code="busy",
                           headers={"Retry-After": "1"})  # fmt: skip
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)


class ModelChecks:
    """Each user's submits that are building models now (this process)."""

    def __init__(self, per_user: int, per_request: int):
        self.per_user, self.per_request = per_user, per_request
        self.held: Counter[int] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def bounded(self, user_id: int) -> Iterator[modelsize.Budget]:
        """A Budget for one submit of `user_id`'s; its slot, once claimed, is given back
        when the block ends."""
        claimed = False

        def claim() -> None:
            nonlocal claimed
            with self._lock:
                if self.held[user_id] >= self.per_user:
                    raise ApiError(
                        429,
                        f"you have {self.held[user_id]} submits building models to count "
                        "them, the most allowed (TORCHYARD_MAX_MODEL_CHECKS_PER_USER); retry "
                        "once they are answered",
                        code="too_many_model_checks",
                        details={"limit": self.per_user},
                        headers={"Retry-After": str(RETRY_AFTER_S)},
                    )
                self.held[user_id] += 1
                claimed = True

        try:
            with modelsize.bounded(modelsize.Budget(self.per_request, claim)) as budget:
                yield budget
        finally:
            if claimed:
                with self._lock:
                    self.held[user_id] -= 1
                    if not self.held[user_id]:
                        del self.held[user_id]


def too_many_builds(bound: int) -> str:
    """What a problem says of a submit past TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST."""
    return (f"needs more than {bound} different torchvision models built to count them "
            "(TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST); ask for fewer model choices")  # fmt: skip


def lane(request: Request, name: LaneName) -> Lane:
    """The app's lane `name`, made on first use (in the loop that serves requests)."""
    state = request.app.state
    lanes: dict[str, Lane] | None = getattr(state, "lanes", None)
    if lanes is None:
        lanes = state.lanes = {}
    if name not in lanes:
        settings: Settings = state.settings
        threads = (
            settings.api_check_threads if name == "checks" else settings.api_costly_read_threads
        )
        lanes[name] = Lane(threads)
    return lanes[name]


def _model_checks(request: Request) -> ModelChecks:
    state = request.app.state
    checks: ModelChecks | None = getattr(state, "model_checks", None)
    if checks is None:
        s: Settings = state.settings
        checks = state.model_checks = ModelChecks(
            s.max_model_checks_per_user, s.max_model_checks_per_request
        )
    return checks


async def run_checks(request: Request, user_id: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, a submit's checks (and store calls), on the `checks` lane under the
    submitter's Budget. A TooManyBuilds that `fn` does not name more precisely is a 422 on
    the spec's model."""
    checks = _model_checks(request)

    def bounded() -> T:
        with checks.bounded(user_id):
            try:
                return fn(*args)
            except modelsize.TooManyBuilds as e:
                raise validation_error([("model", too_many_builds(e.bound))], "spec") from None

    return await lane(request, "checks").run(bounded)
