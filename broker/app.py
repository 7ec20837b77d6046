"""The Celery application shared by the API (which only sends wake-ups), the scheduler and
the workers: task and queue names, wake-ups, and the consumer factory.

The store is the truth; the broker is only a wake-up. Messages are JSON and carry ids
only. Celery is imported lazily so that importing `torchyard.broker` stays cheap. Of ours,
this part imports `torchyard.settings` only.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from torchyard.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)

SCHEDULE_TASK = "torchyard.schedule"
RUN_TASK = "torchyard.run_assignment"
# A worker sends this to its own queue to come back after being marked lost: running it
# proves its consumer works (a hung consumer never registers again).
REGISTER_TASK = "torchyard.register_self"
# Longer than any job: a late-acked message is not redelivered while its job still runs.
VISIBILITY_TIMEOUT_S = 30 * 24 * 3600


def control_queue(settings: Settings) -> str:
    return f"{settings.queue_prefix}.control"


def worker_queue(settings: Settings, worker_id: str) -> str:
    return f"{settings.queue_prefix}.worker.{worker_id}"


def transport_options(settings: Settings) -> dict[str, Any]:
    if settings.broker.startswith("filesystem"):
        folder = settings.broker_dir
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        return {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": 0.05,
        }
    return {"visibility_timeout": VISIBILITY_TIMEOUT_S}


def use_fixed_filesystem_transport() -> None:
    """`filesystem://` means broker/fs_transport.py (kombu's transport without its races)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES["filesystem"] = "torchyard.broker.fs_transport:Transport"


def make_celery(settings: Settings) -> Celery:
    from celery import Celery

    use_fixed_filesystem_transport()

    app = Celery("torchyard", broker=settings.broker, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_default_queue=control_queue(settings),
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
    )
    return app


_apps: dict[str, Celery] = {}


def _app(settings: Settings) -> Celery:
    key = f"{settings.broker}|{settings.broker_dir}|{settings.queue_prefix}"
    if key not in _apps:
        _apps[key] = make_celery(settings)
    return _apps[key]


def wake_scheduler(settings: Settings) -> bool:
    """Ask the scheduler to look at the queue now. Never raises: if the broker is down the
    periodic tick still schedules the job, so a submit never fails for a lost wake-up."""
    try:
        _app(settings).send_task(
            SCHEDULE_TASK, args=[], queue=control_queue(settings), retry=False, ignore_result=True
        )
        return True
    except Exception as e:  # the wake-up is best effort by design
        log.warning("scheduler wake-up not sent (%s); the periodic tick will pick the job up", e)
        return False


def broker_ok(settings: Settings, timeout: float = 2.0) -> bool:
    """True when the broker accepts a connection (used by /readyz)."""
    try:
        with _app(settings).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
        return True
    except Exception:
        return False


# Celery's warning for a consumer started as root (celery/platforms.py, ROOT_DISCOURAGED),
# matched by its opening words; its other security warnings are left as they are.
ROOT_WARNING = r"You're running the worker with superuser privileges"


def quiet_root_warning(app: Celery) -> None:
    """Silence Celery's "running the worker with superuser privileges ... use --uid" warning,
    and only it. Running our consumers as root is by design, and safe:
    - a root worker is root so that it can drop privileges itself: worker/sandbox.py runs
      each trainer (the only place a user's code runs) under bubblewrap and seccomp, as
      that user's own unprivileged host uid (store/sandboxuids.py; never root), via setpriv;
      Celery's --uid would instead drop the whole worker, which then could not do that;
    - the broker carries JSON with ids only (make_celery: accept_content ["json"]), so the
      pickle risk the warning is about cannot arise: with pickle accepted Celery still
      refuses to start as root (SecurityError), as this function checks first.
    The scheduler's consumer (scheduler/process.py) runs no user code at all."""
    from celery.exceptions import SecurityWarning

    accepted = set(app.conf.accept_content or ())
    if accepted - {"json", "application/json"}:
        return  # not our JSON-only app: Celery's warning (or refusal) stands
    warnings.filterwarnings("ignore", message=ROOT_WARNING, category=SecurityWarning)


def make_consumer(app: Celery, *, name: str, queue: str) -> Any:
    """A Celery worker consuming one queue, one task at a time, in this process (solo pool:
    no forked child) and without the broker chatter (heartbeats, mingle, gossip) that a
    store-driven cluster does not use. `name` is the worker's Celery host name. A root
    worker is not told to use --uid (quiet_root_warning says why)."""
    import socket

    quiet_root_warning(app)
    return app.Worker(
        hostname=f"{name}@{socket.gethostname()}",
        queues=[queue],
        pool_cls="solo",
        concurrency=1,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        loglevel=logging.getLevelName(logging.getLogger().level),
        quiet=True,
    )
