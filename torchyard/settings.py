"""The one settings object for every torchyard process, read from TORCHYARD_* variables.

With nothing set everything lives under `./.torchyard`: a SQLite database, an
embedded broker that needs no server, local storage and CPU workers.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DB_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg")
BROKER_SCHEMES = ("filesystem", "redis", "rediss", "amqp", "memory")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TORCHYARD_", env_file=".env", extra="ignore", validate_default=True
    )

    home: Path = Path(".torchyard")
    """TORCHYARD_HOME: where the embedded defaults keep their files."""
    database_url: str | None = None
    """TORCHYARD_DATABASE_URL: postgresql+psycopg://… or sqlite:///… (default: SQLite in home)."""
    broker_url: str | None = None
    """TORCHYARD_BROKER_URL: redis://… in production (default: an embedded filesystem broker)."""
    storage_root: Path | None = None
    """TORCHYARD_STORAGE_ROOT: job directories (run dirs, checkpoints, logs)."""
    data_root: Path | None = None
    """TORCHYARD_DATA_ROOT: data sets in torchvision's on-disk formats."""
    max_world_size: int = Field(default=64, ge=1)
    """TORCHYARD_MAX_WORLD_SIZE: largest world_size a job may ask for."""
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    """TORCHYARD_MAX_BODY_BYTES: larger request bodies get 413."""
    api_threads: int = Field(default_factory=lambda: min(8, max(2, os.cpu_count() or 2)), ge=1)
    """TORCHYARD_API_THREADS: threads the API runs blocking store calls on (default: the
    cores, 2 to 8)."""
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    """TORCHYARD_HEARTBEAT_INTERVAL_S: how often a worker reports it is alive."""
    heartbeat_timeout_s: float = Field(default=20.0, gt=0)
    """TORCHYARD_HEARTBEAT_TIMEOUT_S: a worker silent this long is lost and its job re-queued."""
    cancel_grace_s: float = Field(default=10.0, ge=0)
    """TORCHYARD_CANCEL_GRACE_S: time between SIGTERM and SIGKILL of a cancelled trainer."""
    preempt_after_s: float = Field(default=30.0, ge=0)
    """TORCHYARD_PREEMPT_AFTER_S: how long a queued job waits for workers held by
    lower-priority jobs before it preempts them (0: at once)."""
    fairshare_half_life_s: float = Field(default=86_400.0, gt=0)
    """TORCHYARD_FAIRSHARE_HALF_LIFE_S: the half-life of the usage fair share orders users
    by (default one day: yesterday's worker-hour counts half)."""
    rendezvous_timeout_s: float = Field(default=60.0, gt=0)
    """TORCHYARD_RENDEZVOUS_TIMEOUT_S: how long a rank waits for rank 0's endpoint."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """TORCHYARD_COLLECTIVE_TIMEOUT_S: how long a DDP rank waits in a collective before it
    gives up on its peers (a backstop: the worker of a rank that failed ends the attempt,
    and the others' workers stop their trainers, within seconds)."""
    advertise_addr: str | None = None
    """TORCHYARD_ADVERTISE_ADDR: address other hosts use to reach this host's rendezvous
    (default: the address the host name resolves to; set it on multi-host clusters)."""
    trainer_threads: int | None = Field(default=None, ge=1, le=1024)
    """TORCHYARD_TRAINER_THREADS: CPU threads per trainer (default: torch's). Several CPU
    workers on one host should split its cores (`torchyard up` does), as oversubscribed
    threads slow training many times over. Fixed per cluster, not derived from load, since
    CPU results are bitwise reproducible (exact resume) only at one thread count."""
    warm_trainer: bool = True
    """TORCHYARD_WARM_TRAINER: each worker keeps one trainer process started, torch imported,
    waiting for its next one-rank job (worker/standby.py), so the job's first step comes
    without the import wait; it holds ~680 MB of memory while idle. false: start every
    trainer when its job arrives."""
    claim_timeout_s: float = Field(default=30.0, gt=0)
    """TORCHYARD_CLAIM_TIMEOUT_S: an assignment no worker has claimed this long after it was
    sent is handed back (not counted as a failure) and given to another worker; the silent
    worker is marked lost until its consumer shows it is alive."""
    db_pool_timeout_s: float = Field(default=2.0, gt=0)
    """TORCHYARD_DB_POOL_TIMEOUT_S: how long a request waits for a database connection before
    the API answers 503 with Retry-After (never a hang)."""
    max_model_params: int = Field(default=2_000_000_000, ge=1)
    """TORCHYARD_MAX_MODEL_PARAMS: a spec whose model would have more parameters is refused
    (422 naming the field)."""
    max_data_bytes: int = Field(default=16 * 1024**3, ge=1)
    """TORCHYARD_MAX_DATA_BYTES: a spec whose data set would take more bytes on the device is
    refused (422 naming the field)."""
    max_bundle_files: int = Field(default=10_000, ge=1)
    """TORCHYARD_MAX_BUNDLE_FILES: most files a code bundle (POST /v1/bundles) may hold; an
    archive with more is refused (422) before anything of it is kept."""
    max_bundle_bytes: int = Field(default=200 * 1024**2, ge=1024)
    """TORCHYARD_MAX_BUNDLE_BYTES: largest code bundle, both as uploaded (gzip, 413) and
    unpacked (422), so a small archive that inflates cannot fill the workers' disks."""
    metrics_page_points: int = Field(default=10_000, ge=100)
    """TORCHYARD_METRICS_PAGE_POINTS: most points per series a metrics response returns when
    `max_points` is not given; the rest is paged with `after_step`."""
    queue_prefix: str = Field(default="torchyard", pattern=r"^[A-Za-z0-9_.-]+$")
    """TORCHYARD_QUEUE_PREFIX: prefix of every broker queue name (one prefix per cluster)."""

    @field_validator("database_url")
    @classmethod
    def _db_scheme(cls, v: str | None) -> str | None:
        if v is not None and v.split(":", 1)[0] not in DB_SCHEMES:
            raise ValueError(
                f"TORCHYARD_DATABASE_URL must start with one of {', '.join(DB_SCHEMES)}"
            )
        if v is not None and v.startswith("postgresql://"):
            v = "postgresql+psycopg://" + v.removeprefix("postgresql://")
        return v

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, v: str | None) -> str | None:
        if v is not None and v.split(":", 1)[0] not in BROKER_SCHEMES:
            raise ValueError(
                f"TORCHYARD_BROKER_URL must start with one of {', '.join(BROKER_SCHEMES)}"
            )
        return v

    @model_validator(mode="after")
    def _timeouts(self) -> Settings:
        if self.heartbeat_timeout_s <= 3 * self.heartbeat_interval_s:
            raise ValueError(
                "TORCHYARD_HEARTBEAT_TIMEOUT_S must be more than three times "
                "TORCHYARD_HEARTBEAT_INTERVAL_S, or live workers would be reaped (and a "
                "worker cut off from the store could not stop its trainer in time)"
            )
        return self

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'torchyard.db').resolve()}"

    @property
    def broker(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def storage(self) -> Path:
        return (self.storage_root or self.home / "storage").resolve()

    @property
    def data(self) -> Path:
        return (self.data_root or self.home / "data").resolve()

    @property
    def broker_dir(self) -> Path:
        """Folder of the embedded filesystem broker."""
        return (self.home / "broker").resolve()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, validated once; tests call `get_settings.cache_clear()`."""
    return Settings()


# The start-up steps every service command shares (api, scheduler, worker).


def load_settings() -> Settings | None:
    """The settings, or None after printing each bad TORCHYARD_* variable to stderr."""
    try:
        return get_settings()
    except ValidationError as e:
        for err in e.errors():
            print(f"torchyard: bad setting: {err['msg']}", file=sys.stderr)
        return None


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )
