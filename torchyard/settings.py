"""The one settings object for every torchyard process, read from TORCHYARD_* variables.

With nothing set everything lives under `./.torchyard`: a SQLite database, an
embedded broker that needs no server, local storage and CPU workers.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
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
    storage_url: str | None = None
    """TORCHYARD_STORAGE_URL: where stored files live: `file:///path` (the default, the
    storage root) or `s3://bucket/prefix` (any S3-compatible store; the storage root is then
    this host's cache: run directories, fetched checkpoints, bundles and data sets)."""
    s3_endpoint_url: str | None = None
    """TORCHYARD_S3_ENDPOINT_URL: the S3 API's address for a store other than AWS's own
    (SeaweedFS, MinIO, Ceph, R2…); credentials come from AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_REGION or the rest of the usual credential chain."""
    s3_part_bytes: int = Field(default=8 * 1024**2, ge=5 * 1024**2)
    """TORCHYARD_S3_PART_BYTES: files larger than this go up in multipart uploads of parts
    this large (S3's minimum part is 5 MiB)."""
    s3_concurrency: int = Field(default=8, ge=1, le=64)
    """TORCHYARD_S3_CONCURRENCY: parts (or ranges) one upload or download moves at once."""
    download_redirect: bool = False
    """TORCHYARD_DOWNLOAD_REDIRECT: with an object store, answer a checkpoint download with a
    redirect to a presigned URL (clients fetch straight from the store) instead of streaming
    it through the API. Only where every client reaches the store's endpoint."""
    data_root: Path | None = None
    """TORCHYARD_DATA_ROOT: data sets in torchvision's on-disk formats."""
    max_world_size: int = Field(default=64, ge=1)
    """TORCHYARD_MAX_WORLD_SIZE: largest world_size a job may ask for."""
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    """TORCHYARD_MAX_BODY_BYTES: larger request bodies get 413."""
    max_json_depth: int = Field(default=64, ge=2, le=1000)
    """TORCHYARD_MAX_JSON_DEPTH: a JSON request body nested deeper (arrays and objects) is
    refused with 422 before it is parsed (the parsers recurse once per level)."""
    max_streams_per_user: int = Field(default=20, ge=1)
    """TORCHYARD_MAX_STREAMS_PER_USER: event streams (SSE) one user may hold open at once
    in one API process; the next gets 429 with Retry-After."""
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
    schema_wait_s: float = Field(default=300.0, ge=0)
    """TORCHYARD_SCHEMA_WAIT_S: how long the api, scheduler and worker wait at start for the
    database to reach their schema (`torchyard db upgrade`, run by one process) before they
    exit saying so; 0: do not wait. A database migrated by a newer release is refused at
    once."""
    schema_watch_s: float = Field(default=60.0, ge=0)
    """TORCHYARD_SCHEMA_WATCH_S: how often a running api, scheduler or worker reads the
    database's schema revision; once a newer release has migrated it, the process stops as
    on SIGTERM (a worker hands its job back first) rather than go on with old code. 0: off."""
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
    max_dataset_upload_bytes: int = Field(default=16 * 1024**3, ge=1024)
    """TORCHYARD_MAX_DATASET_UPLOAD_BYTES: largest ImageFolder set sent to POST /v1/datasets
    (`torchyard data upload`), both as sent (413) and unpacked (422)."""
    max_bundle_storage_bytes: int = Field(default=2 * 1024**3, ge=1024)
    """TORCHYARD_MAX_BUNDLE_STORAGE_BYTES: the bytes of code bundles (as uploaded) one user
    may keep; an upload past it is refused (413) until old bundles are removed."""
    bundle_retention_s: float = Field(default=30 * 86_400.0, gt=0)
    """TORCHYARD_BUNDLE_RETENTION_S: a bundle neither uploaded nor named by a submitted job
    for this long, and named by no queued or running job or active sweep, is removed by
    the scheduler (default 30 days)."""
    metrics_page_points: int = Field(default=10_000, ge=100)
    """TORCHYARD_METRICS_PAGE_POINTS: most points per series a metrics response returns when
    `max_points` is not given; the rest is paged with `after_step`."""
    log_grep_scan_bytes: int = Field(default=64 * 1024**2, ge=1024)
    """TORCHYARD_LOG_GREP_SCAN_BYTES: most bytes of a job's log one search request
    (`GET /v1/jobs/{id}/logs?grep=`) scans; it answers `next_offset` to go on from."""
    max_event_line_bytes: int = Field(default=64 * 1024, ge=1024)
    """TORCHYARD_MAX_EVENT_LINE_BYTES: longest line of a job's events.jsonl the worker reads;
    a longer one is set aside (counted, reported in the job log and its attempt's reason)."""
    max_metric_name_chars: int = Field(default=100, ge=1, le=100)
    """TORCHYARD_MAX_METRIC_NAME_CHARS: longest metric name a job may log (at most 100, the
    store's column); a longer one is set aside, never cut to fit."""
    max_metric_names: int = Field(default=1000, ge=1)
    """TORCHYARD_MAX_METRIC_NAMES: distinct metric names one job may log; points of any
    further name are set aside."""
    max_run_dir_bytes: int = Field(default=20 * 1024**3, ge=1024**2)
    """TORCHYARD_MAX_RUN_DIR_BYTES: most bytes a job's run directory may hold (checkpoints,
    logs, whatever its code writes); over it the worker stops the trainer and fails the job
    with the error kind `run_dir_full` (the job's own, not a fault of the host)."""
    trainer_memory_bytes: int | None = Field(default=None, ge=64 * 1024**2)
    """TORCHYARD_TRAINER_MEMORY_BYTES: the memory limit of each trainer's own memory cgroup
    (worker/cgroups.py), where the host has cgroups; over it the kernel kills the trainer
    alone and the job fails as `out_of_memory`. Default: 90% of the worker's own cgroup
    limit if it has one, else 90% of the host's memory."""
    trainer_max_pids: int = Field(default=1024, ge=0)
    """TORCHYARD_TRAINER_MAX_PIDS: most tasks (processes and threads: torch's thread pools,
    DataLoader workers and theirs all count) in each slot's trainer cgroup, where the host
    offers the `pids` controller (worker/cgroups.py); past it a fork fails inside the job and
    nothing outside notices. 0: no limit."""
    sandbox: Literal["on", "off"] = "on"
    """TORCHYARD_SANDBOX: `on` runs every trainer inside bubblewrap (worker/sandbox.py): no
    TORCHYARD_HOME, no other job's files, no worker environment. `off` (an admin's explicit
    choice) runs trainers with the worker's rights. Where a host cannot sandbox, its workers
    say so at start and refuse jobs that run user code unless this is `off`."""
    sandbox_uid: int = Field(default=64000, ge=1, le=2**31 - 2)
    """TORCHYARD_SANDBOX_UID: where the unprivileged host uids (and gids) a root worker's
    trainers run as begin: this one is no user's (a slot's first warm trainer, jobs with no
    owner), each user gets one of the TORCHYARD_SANDBOX_UID_COUNT after it. Never 0, and no
    account is needed. A worker that is not root runs them as uid 1000 of a user namespace
    instead."""
    sandbox_uid_count: int = Field(default=1000, ge=1, le=2**30)
    """TORCHYARD_SANDBOX_UID_COUNT: how many users may have a sandbox uid of their own: a
    root worker runs each user's trainers as a host uid given to that user alone
    (store/sandboxuids.py), TORCHYARD_SANDBOX_UID + 1 up to TORCHYARD_SANDBOX_UID + this
    count; keep the range clear of the host's own users."""
    sandbox_network: Literal["host", "none"] = "host"
    """TORCHYARD_SANDBOX_NETWORK: `host` (default) lets sandboxed trainers use the host's
    network; `none` gives each one-rank trainer (and the slot's zygote) a network namespace
    of its own with loopback only: no broker, database, object store, other job's socket or
    the internet (a job that downloads weights fails). DDP ranks (world size > 1) always
    have the host's network: they rendezvous over it."""
    max_log_bytes: int = Field(default=256 * 1024**2, ge=4096)
    """TORCHYARD_MAX_LOG_BYTES: most bytes a job's log keeps; past it the log is cut with a
    marker line and further output is dropped while the job goes on."""
    sys_metrics_interval_s: float = Field(default=5.0, ge=0)
    """TORCHYARD_SYS_METRICS_INTERVAL_S: how often each worker samples its trainer's process
    tree (CPU, memory) and its GPU into the job's `sys/…` series (worker/sysmetrics.py);
    `0` turns sampling off. At least 1: the series are indexed by whole Unix seconds."""

    @field_validator("sys_metrics_interval_s")
    @classmethod
    def _sys_metrics_interval(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("0 (off) or at least 1 second: the samples are indexed by second")
        return v

    queue_prefix: str = Field(default="torchyard", pattern=r"^[A-Za-z0-9_.-]+$")
    """TORCHYARD_QUEUE_PREFIX: prefix of every broker queue name (one prefix per cluster)."""
    metrics_token: str | None = Field(default=None, min_length=16, max_length=200)
    """TORCHYARD_METRICS_TOKEN: a bearer token (16 characters or more) that may read
    `/metrics` without being a user, for a Prometheus scraper (default none: admins only)."""
    metrics_port: int | None = None
    """TORCHYARD_METRICS_PORT: the scheduler and each worker serve Prometheus metrics at
    `http://<TORCHYARD_METRICS_ADDR>:<port>/metrics` (default: off; `--metrics-port`
    overrides it; `torchyard up` gives its scheduler this port and worker i port + 1 + i).
    The API serves its own at `/metrics` on its port. See docs/monitoring.md."""
    metrics_addr: str = "127.0.0.1"
    """TORCHYARD_METRICS_ADDR: the address the scheduler's and the workers' metrics listen on
    (default 127.0.0.1: they name job ids and workers, and need no token, so exposing them
    to a network, e.g. `0.0.0.0` for a Prometheus on another host, is the operator's call)."""
    trusted_proxies: str = ""
    """TORCHYARD_TRUSTED_PROXIES: comma-separated IPs or CIDRs of reverse proxies whose
    `X-Forwarded-Proto` and `X-Forwarded-For` are believed (default none): a login cookie
    is `Secure` when the request came over https directly, or through one of these saying
    it did; the audit trail records the client address such a proxy appended."""
    api_docs: bool = False
    """TORCHYARD_API_DOCS: serve the interactive API docs at `/docs` and `/redoc` (off by
    default: their pages load scripts from a third-party CDN on the dashboard's origin;
    `/openapi.json` is always served and any OpenAPI viewer reads it)."""
    webhook_deny_networks: str = (
        "169.254.0.0/16,fe80::/10,100.100.100.200/32,fd00:ec2::254/128,0.0.0.0/32,::/128"
    )
    """TORCHYARD_WEBHOOK_DENY_NETWORKS: comma-separated CIDRs no webhook is ever sent to,
    whatever TORCHYARD_WEBHOOK_ALLOW_NETWORKS says (default: link-local and the clouds'
    metadata addresses). Checked when a webhook is created (a literal address) and before
    each send, on every address its host name resolves to (scheduler/webhook_guard.py)."""
    webhook_allow_networks: str = ""
    """TORCHYARD_WEBHOOK_ALLOW_NETWORKS: comma-separated CIDRs a webhook may reach although
    they are not public (default none: loopback, private, link-local, carrier-grade NAT,
    NAT64, 6to4, multicast… are refused), e.g. `10.20.0.0/16` for a receiver on the
    company network; an IPv4 address inside a NAT64 or 6to4 one must be allowed too."""
    webhook_poll_s: float = Field(default=1.0, gt=0, le=60)
    """TORCHYARD_WEBHOOK_POLL_S: how often the scheduler's webhook sender looks for due
    deliveries (it is also woken by every scheduler wake-up, e.g. a job's end)."""
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=60)
    """TORCHYARD_WEBHOOK_TIMEOUT_S: seconds a webhook receiver has to connect and answer."""
    webhook_retry_base_s: float = Field(default=10.0, gt=0, le=3600)
    """TORCHYARD_WEBHOOK_RETRY_BASE_S: the first retry's delay; later ones grow (3, 6, 12,
    30 … up to 360 times it, at most one hour), with ±20% jitter, for a day, then the
    delivery is marked failed."""
    webhook_retention_s: float = Field(default=30 * 86_400.0, ge=0)
    """TORCHYARD_WEBHOOK_RETENTION_S: a delivery sent (or given up) this long after its event
    is removed with its tries by the scheduler, hourly (default 30 days; 0: kept forever).
    Pending deliveries are never removed."""
    oidc_issuer: str | None = None
    """TORCHYARD_OIDC_ISSUER: single sign-on with this OpenID Connect provider (its issuer
    URL, https but for a loopback address; found by discovery,
    `<issuer>/.well-known/openid-configuration`). SSO is on when this and
    TORCHYARD_OIDC_CLIENT_ID are set (TORCHYARD_OIDC_CLIENT_SECRET is then required)."""
    oidc_client_id: str | None = None
    """TORCHYARD_OIDC_CLIENT_ID: torchyard's client at the provider (a confidential client
    whose redirect URI is `<api url>/v1/ui/sso/callback`)."""
    oidc_client_secret: str | None = Field(default=None, repr=False)
    """TORCHYARD_OIDC_CLIENT_SECRET: that client's secret; it never leaves the server."""
    oidc_name: str = ""
    """TORCHYARD_OIDC_NAME: what the login page calls the provider ("Sign in with …";
    default: the issuer's host name)."""
    oidc_scopes: str = "openid profile email groups"
    """TORCHYARD_OIDC_SCOPES: the scopes asked for, those the provider lists as supported
    (`openid` always)."""
    oidc_user_claim: str = Field(default="preferred_username", min_length=1)
    """TORCHYARD_OIDC_USER_CLAIM: the claim whose value is the torchyard user name."""
    oidc_groups_claim: str = Field(default="groups", min_length=1)
    """TORCHYARD_OIDC_GROUPS_CLAIM: the claim listing the user's groups at the provider."""
    oidc_admin_groups: str = ""
    """TORCHYARD_OIDC_ADMIN_GROUPS: comma-separated groups whose members are admins
    (applied at each SSO login; admin rights that came from a group go with it)."""
    oidc_project_roles: str = ""
    """TORCHYARD_OIDC_PROJECT_ROLES: comma-separated `group=project:role` (e.g.
    `ml-team=lab:member,ml-leads=lab:owner`): at each SSO login a member of the group gets at
    least that role in that existing project; a role that came from a group the user has
    left is taken away."""
    api_check_threads: int = Field(default=2, ge=1)
    """TORCHYARD_API_CHECK_THREADS: threads the API checks job and sweep submits on (a
    `torchvision/<name>` model is built to be counted), apart from the threads that serve
    reads, so that slow checks never hold a read up."""
    max_model_checks_per_request: int = Field(default=8, ge=1)
    """TORCHYARD_MAX_MODEL_CHECKS_PER_REQUEST: distinct `torchvision/<name>` models not yet
    counted that one submit may need built (a sweep's choices each make one); past it 422."""
    max_model_checks_per_user: int = Field(default=1, ge=1)
    """TORCHYARD_MAX_MODEL_CHECKS_PER_USER: a user's submits building models at once, per
    API process; the next one that needs a build gets 429."""
    api_costly_read_threads: int = Field(default=2, ge=1)
    """TORCHYARD_API_COSTLY_READ_THREADS: threads the API runs log searches and metrics
    pages on, apart from the threads that serve other reads."""
    metrics_page_total_points: int = Field(default=100_000, ge=1000)
    """TORCHYARD_METRICS_PAGE_TOTAL_POINTS: most points (raw, or buckets with `max_points`)
    one metrics response holds across all its series; a point is at most ~70 bytes of JSON,
    so a page is at most ~7 MB at the default."""
    log_grep_max_s: float = Field(default=1.0, gt=0)
    """TORCHYARD_LOG_GREP_MAX_S: the time one log search request may take; past it the
    search stops between chunks and answers what it found (`stopped_early`, `next_offset`)."""

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

    @field_validator("trusted_proxies", "webhook_deny_networks", "webhook_allow_networks")
    @classmethod
    def _networks(cls, v: str, info: ValidationInfo) -> str:
        for part in _split(v):
            try:
                ipaddress.ip_network(part, strict=False)
            except ValueError:
                name = f"TORCHYARD_{(info.field_name or '').upper()}"
                raise ValueError(f"{name}: {part!r} is not an IP address or CIDR") from None
        return v

    @field_validator("metrics_port")
    @classmethod
    def _metrics_port(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 65535:
            raise ValueError(f"TORCHYARD_METRICS_PORT: {v} is not a port (1 to 65535)")
        return v

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(
                f"TORCHYARD_METRICS_ADDR: {v!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0)"
            ) from None
        return v

    @field_validator("oidc_project_roles")
    @classmethod
    def _project_roles(cls, v: str) -> str:
        for part in _split(v):
            if not _PROJECT_ROLE.match(part):
                raise ValueError(
                    f"TORCHYARD_OIDC_PROJECT_ROLES: {part!r} is not group=project:role "
                    "(role: viewer, member or owner)"
                )
        return v

    @model_validator(mode="after")
    def _oidc(self) -> Settings:
        if bool(self.oidc_issuer) != bool(self.oidc_client_id):
            raise ValueError(
                "single sign-on needs both TORCHYARD_OIDC_ISSUER and TORCHYARD_OIDC_CLIENT_ID"
            )
        if self.oidc_issuer and not self.oidc_client_secret:
            raise ValueError("single sign-on needs TORCHYARD_OIDC_CLIENT_SECRET too")
        if self.oidc_issuer and not _secure_url(self.oidc_issuer):
            raise ValueError(
                "TORCHYARD_OIDC_ISSUER must be an https:// URL (http:// only on a loopback address)"
            )
        return self

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
    def trusted_proxy_networks(self) -> tuple[IPNetwork, ...]:
        """TORCHYARD_TRUSTED_PROXIES parsed (checked at start)."""
        return tuple(ipaddress.ip_network(p, strict=False) for p in _split(self.trusted_proxies))

    @property
    def webhook_denied(self) -> tuple[IPNetwork, ...]:
        """TORCHYARD_WEBHOOK_DENY_NETWORKS parsed (checked at start)."""
        return tuple(
            ipaddress.ip_network(p, strict=False) for p in _split(self.webhook_deny_networks)
        )

    @property
    def webhook_allowed(self) -> tuple[IPNetwork, ...]:
        """TORCHYARD_WEBHOOK_ALLOW_NETWORKS parsed (checked at start)."""
        return tuple(
            ipaddress.ip_network(p, strict=False) for p in _split(self.webhook_allow_networks)
        )

    @property
    def sso_enabled(self) -> bool:
        """Whether single sign-on is configured (TORCHYARD_OIDC_ISSUER and _CLIENT_ID)."""
        return bool(self.oidc_issuer and self.oidc_client_id)

    @property
    def oidc_admin_group_set(self) -> frozenset[str]:
        return frozenset(_split(self.oidc_admin_groups))

    @property
    def oidc_project_role_map(self) -> tuple[tuple[str, str, str], ...]:
        """TORCHYARD_OIDC_PROJECT_ROLES parsed: (group, project, role) each."""
        found = []
        for part in _split(self.oidc_project_roles):
            group, _, rest = part.partition("=")
            project, _, role = rest.rpartition(":")
            found.append((group.strip(), project.strip(), role.strip()))
        return tuple(found)

    @property
    def broker_dir(self) -> Path:
        """Folder of the embedded filesystem broker."""
        return (self.home / "broker").resolve()


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _split(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


# group=project:role, the project named as store/projects.py's NAME_RE allows.
_PROJECT_ROLE = re.compile(
    r"^[^=,]+=\s*[A-Za-z0-9][A-Za-z0-9._-]{0,99}\s*:\s*(viewer|member|owner)$"
)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _secure_url(url: str) -> bool:
    """https, or http to this host (a provider on the same machine, as tests run one)."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return True
    return parts.scheme == "http" and (parts.hostname or "") in _LOOPBACK


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


def private_umask() -> int:
    """Files and folders this process creates are its user's alone (umask 077): the
    database, the broker's messages, tokens, run directories and logs. Every service
    command (api, scheduler, worker, up, db, token) calls it first; returns the old mask."""
    return os.umask(0o077)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )
    # The schema check at start (store/migrate.py) loads Alembic, whose INFO lines (its
    # plugins, the dialect) say nothing to an operator.
    logging.getLogger("alembic").setLevel(max(logging.getLogger().level, logging.WARNING))
