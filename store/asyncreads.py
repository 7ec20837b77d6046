"""The API's hottest read, a job (GET /v1/jobs/{id} and its conditional form), on
PostgreSQL as async psycopg calls on the event loop.

The statements are store/jobs.py's own (`snapshot_stmt`, `VERSION_STMTS`), compiled
once, and each column goes through its SQLAlchemy type's result processing, so a job read
here is the dict `job_snapshot` returns (a test compares them). What is skipped is the store
thread-pool hop and SQLAlchemy's execution layer: on a 2-core host they cost more CPU per
request than the query (bench/api_bench.py). SQLite has no async driver worth the name
here; its reads stay in the thread pool.

Faults: connections carry the same timeouts and keepalives as the sync path's
(store/db.py PG_CONNECT_ARGS). While the store is down a read fails within `pool_timeout`
with psycopg's OperationalError (the API's 503 "unavailable"); waiting that long while
other reads hold every connection is psycopg_pool.PoolTimeout (503 "busy"). Once the store
is back no read fails: a connection broken by the restart sends its read to a fresh one
(see `_fetchone`), and no reconnection waits on the pool's backoff (see `AsyncReads`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from psycopg import AsyncConnection, OperationalError
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from sqlalchemy import make_url
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.sql import Select

from torchyard.store.db import PG_CONNECT_ARGS
from torchyard.store.jobs import (
    VERSION_STMTS,
    Viewer,
    snapshot_from_row,
    snapshot_stmt,
    viewer_params,
)

_DIALECT = pg_psycopg.dialect()


class _Compiled(NamedTuple):
    sql: str
    names: list[str]
    processors: list[Callable[[Any], Any] | None]


@functools.cache
def _compiled(which: str, admin: bool) -> _Compiled:
    stmt: Select[Any] = (
        snapshot_stmt("postgresql", admin) if which == "job" else VERSION_STMTS[admin]
    )
    compiled = stmt.compile(dialect=_DIALECT)
    cols = list(stmt.selected_columns)
    return _Compiled(
        compiled.string,
        [str(c.key) for c in cols],
        [c.type.dialect_impl(_DIALECT).result_processor(_DIALECT, None) for c in cols],
    )


def conninfo(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://…) as the URI libpq reads."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncReads:
    """A small pool of autocommit async connections (one statement is one snapshot).

    The pool replaces a lost connection in the background, retrying with a backoff that
    doubles (1, 2, 4 … 32 s) for `reconnect_timeout`, and while those retries hold its
    slots it opens no other connection: after a 30 s outage with the default 5 minutes,
    reads failed for up to 30 s more although the store was back (the chaos test saw it).
    Retrying only as long as a read waits (`pool_timeout`) hands reconnection to the reads
    themselves: a read that finds no connection makes the pool grow, at once."""

    def __init__(self, url: str, *, pool_timeout: float, max_size: int = 10):
        self.pool = AsyncConnectionPool(
            conninfo(url),
            min_size=1,
            max_size=max_size,
            timeout=pool_timeout,
            reconnect_timeout=pool_timeout,
            kwargs={"autocommit": True, **PG_CONNECT_ARGS},
            open=False,
        )
        self.in_use = 0  # connections lent out now

    async def open(self) -> None:
        await self.pool.open(wait=False)  # a store that is down now must not stop the API

    async def close(self) -> None:
        await self.pool.close()

    async def _getconn(self) -> AsyncConnection[Any]:
        """A pooled connection (give it back with `_putconn`). Waiting past the pool timeout
        while none is lent out means none can be made: psycopg's OperationalError (the store
        is unreachable), not the pool's timeout (busy)."""
        try:
            conn = await self.pool.getconn()
        except PoolTimeout:
            if self.in_use == 0:
                raise OperationalError("no connection to the database could be made") from None
            raise
        self.in_use += 1
        return conn

    async def _putconn(self, conn: AsyncConnection[Any]) -> None:
        self.in_use -= 1
        await self.pool.putconn(conn)  # a broken one is dropped and replaced

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        conn = await self._getconn()
        try:
            yield conn
        finally:
            await self._putconn(conn)

    async def _fetchone(self, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """A connection that broke since its last use (the server restarted) is not the
        store being down: the pool drops every idle connection that broke with it, and the
        read runs once more, on a fresh one. Reads are safe to repeat. (Bare getconn and
        putconn, not the pool's context manager: the connections are in autocommit, there
        is no transaction to end, and the hot path saves two context managers.)"""
        retried = False
        while True:
            conn = await self._getconn()
            try:
                cur = await conn.execute(sql, params)
                return await cur.fetchone()
            except OperationalError:
                if retried or not conn.broken:
                    raise
            finally:
                await self._putconn(conn)
            retried = True
            await self.pool.check()

    async def _row(self, which: str, viewer: Viewer, job_id: str) -> dict[str, Any] | None:
        q = _compiled(which, viewer.is_admin)
        row = await self._fetchone(q.sql, viewer_params(viewer, job_id))
        if row is None:
            return None
        return {
            name: (proc(value) if proc is not None else value)
            for name, proc, value in zip(q.names, q.processors, row, strict=True)
        }

    async def job_snapshot(self, viewer: Viewer, job_id: str) -> dict[str, Any] | None:
        """store/jobs.py `job_snapshot`, awaited."""
        if len(job_id) > 64:
            return None
        row = await self._row("job", viewer, job_id)
        return None if row is None else snapshot_from_row(row)

    async def job_version(self, viewer: Viewer, job_id: str) -> int | None:
        """store/jobs.py `job_version`, awaited."""
        if len(job_id) > 64:
            return None
        row = await self._row("version", viewer, job_id)
        return None if row is None else int(row["version"])
