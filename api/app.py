"""The FastAPI application: `create_app(settings)` builds one; `torchyard api` serves it."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from torchyard.api import errors
from torchyard.api.deps import TokenCache
from torchyard.api.docs import HtmlPolicy, add_docs
from torchyard.api.fanout import FeedHub, stored_log_size
from torchyard.api.jsonlimits import JsonDepthLimit
from torchyard.api.middleware import BodyLimit, PrometheusMetrics, ShedLoad
from torchyard.api.routers import (
    artifacts,
    audit,
    bundles,
    checkpoints,
    datasets,
    health,
    job_data,
    job_edits,
    job_events,
    jobs,
    meta,
    projects,
    queue,
    sso,
    sweeps,
    tokens,
    ui,
    ui_jobs,
    users,
    webhooks,
    workers,
)
from torchyard.contracts.spec import JobSpec
from torchyard.settings import Settings, get_settings
from torchyard.storage import storage_for
from torchyard.store.asyncreads import AsyncReads
from torchyard.store.db import make_engine
from torchyard.store.inventory import job_counts, worker_counts

log = logging.getLogger(__name__)

FEED_POLL_S = 0.5
# Requests waiting for a store thread, per thread, before new ones are shed with 503: a
# store call takes a few ms, so this is well under a second of queue.
SHED_WAITING_PER_THREAD = 64


class _StoreCollector(Collector):
    """Jobs and workers by state, read from the store at scrape time."""

    def __init__(self, app: FastAPI):
        self.app = app

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs_g = GaugeMetricFamily("torchyard_jobs", "jobs by state", labels=["state"])
        workers_g = GaugeMetricFamily("torchyard_workers", "workers by state", labels=["state"])
        try:
            # The read sessions: a scrape must never take SQLite's write lock.
            with self.app.state.read_sessions() as session:
                for state, n in job_counts(session).items():
                    jobs_g.add_metric([state], n)
                for state, n in worker_counts(session).items():
                    workers_g.add_metric([state], n)
        except Exception as e:  # a scrape must not fail because the store is down
            log.warning("metrics: store unreachable: %s", e)
        yield jobs_g
        yield workers_g


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the job spec (the submit body is validated by
    trainer.spec, not by FastAPI, so that every problem is reported in its words)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in spec_schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components["JobSpec"] = spec_schema
    app.openapi_schema = schema
    return schema


def _sessions(settings: Settings) -> tuple[sessionmaker[Session], sessionmaker[Session]]:
    """(sessions for writes, sessions for reads). Both wait at most TORCHYARD_DB_POOL_TIMEOUT_S
    for a connection (then 503, never a hang). Reads never block writers: on SQLite their
    transactions are deferred (no write lock); on PostgreSQL they run in autocommit, with no
    BEGIN/ROLLBACK round trips (one statement is one snapshot anyway) and no pre-ping (a
    round trip per request: a dead connection is found by the statement itself, which
    invalidates the pool; that request gets a 503, the next a fresh connection)."""
    url, timeout = settings.db_url, settings.db_pool_timeout_s
    writes = sessionmaker(make_engine(url, pool_timeout=timeout), expire_on_commit=False)
    if url.startswith("postgresql"):
        engine = make_engine(url, pre_ping=False, pool_timeout=timeout)
        reads = sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"))
    else:
        reads = sessionmaker(make_engine(url, read_only=True, pool_timeout=timeout))
    return writes, reads


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Few threads for the blocking store calls: on a small host dozens of threads fighting
    # for the GIL triple the tail latency (measured by bench/api_bench.py) for no throughput.
    settings: Settings = app.state.settings
    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
    # The hottest read (a job) on the event loop, PostgreSQL only; opened here, in the
    # loop that serves requests (an app whose lifespan never ran reads through threads).
    reads = None
    if settings.db_url.startswith("postgresql"):
        reads = AsyncReads(settings.db_url, pool_timeout=settings.db_pool_timeout_s)
        await reads.open()
    app.state.async_reads = reads
    try:
        yield
    finally:
        app.state.async_reads = None
        if reads is not None:
            await reads.close()
    await app.state.feed_hub.close()
    # Close the pooled connections now, not whenever the engines are collected: a stopped
    # API (or a test's app) must leave no idle PostgreSQL sessions behind.
    for factory in (app.state.sessions, app.state.read_sessions):
        factory.kw["bind"].dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        lifespan=_lifespan,
        title="torchyard",
        version="1",
        description="Run PyTorch training jobs on a shared pool of GPUs. Every route but "
        "/healthz and /readyz needs `Authorization: Bearer <token>`. Errors are "
        '`{"error": {"code", "message", "details"}}`.',
        # FastAPI's docs pages load a CDN's script: off unless TORCHYARD_API_DOCS (api/docs.py).
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.sessions, app.state.read_sessions = _sessions(settings)
    app.state.async_reads = None  # set by the lifespan on PostgreSQL
    app.state.token_cache = TokenCache()
    app.state.feed_poll_s = FEED_POLL_S
    # One store poller per followed job for all its SSE followers (read lazily: tests swap
    # the read sessions).
    app.state.feed_hub = FeedHub(
        lambda: app.state.read_sessions,
        log_size=functools.partial(stored_log_size, storage_for(settings)),
    )
    registry = CollectorRegistry()
    registry.register(_StoreCollector(app))
    app.state.prometheus = registry

    errors.install(app)
    # The dashboard (ui: its page and logins, ui_jobs: its table) last: its page paths
    # never shadow an API route.
    routers = (jobs, job_edits, job_data, job_events, checkpoints, artifacts, bundles, datasets, workers,
               users, queue, health, meta, sweeps, tokens, audit, projects, webhooks, sso, ui_jobs, ui)  # fmt: skip
    for module in routers:
        app.include_router(module.router)
    if settings.api_docs:
        add_docs(app)
    # Each add_middleware wraps the ones before it, so the last added runs first: requests
    # are counted (shed 503s and 413s included: an operator must see them), then the size
    # limit applies before anything reads a body, then the shedder.
    # JSON bodies nested too deep: 422 before any parser recurses (innermost: a body is read
    # only once the size limit and the shedder let the request in).
    app.add_middleware(
        JsonDepthLimit,
        max_depth=settings.max_json_depth,
        skip=(bundles.UPLOAD_PATH, datasets.UPLOAD_PATH),
    )
    app.add_middleware(ShedLoad, max_waiting=SHED_WAITING_PER_THREAD * settings.api_threads)
    # Bundle and data set uploads stream to disk under their own, larger limits, enforced
    # by their routes.
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        own_limit=(bundles.UPLOAD_PATH, datasets.UPLOAD_PATH),
    )
    app.add_middleware(PrometheusMetrics, registry=registry)
    app.add_middleware(HtmlPolicy)  # any HTML answer without a CSP gets the dashboard's
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
