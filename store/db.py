"""Engines and sessions for PostgreSQL (psycopg 3) and SQLite (WAL, busy timeout)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

_engines: dict[str, Engine] = {}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # Set on every connection: WAL lets readers run beside the one writer, and the
    # busy timeout makes a second writer wait instead of failing with "locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
    # Fair share's decay (store/usage.py) needs exp(), which only some SQLite builds have.
    dbapi_conn.create_function("exp", 1, math.exp, deterministic=True)


def make_engine(
    url: str, *, pre_ping: bool = True, read_only: bool = False, pool_timeout: float = 30.0
) -> Engine:
    """`read_only`: for sessions that only read. On SQLite their transactions are deferred
    (a WAL snapshot that never takes the write lock, so a slow reader cannot stall a
    writer); writers' are BEGIN IMMEDIATE (they queue on the busy timeout instead of
    failing with "locked" half-way through). `pool_timeout`: seconds to wait for a pooled
    connection before sqlalchemy.exc.TimeoutError (the API answers 503)."""
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_timeout=pool_timeout,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        # Let SQLAlchemy, not pysqlite, open transactions, so BEGIN IMMEDIATE works.
        begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql(begin))

        @event.listens_for(engine, "connect")
        def _no_autobegin(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None

        return engine
    return create_engine(
        url,
        pool_pre_ping=pre_ping,
        pool_size=10,
        max_overflow=20,
        pool_timeout=pool_timeout,
        connect_args=PG_CONNECT_ARGS,
    )


# A link that dies without a reset (a partition) must fail a call in seconds, not after
# the kernel's ~15 minutes of retransmissions: the worker's watchdog and the scheduler's
# reaper both need calls that return.
PG_CONNECT_ARGS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 10_000,  # ms of unacknowledged data before the socket gives up
}


def get_engine(url: str) -> Engine:
    """One engine per URL per process."""
    if url not in _engines:
        _engines[url] = make_engine(url)
    return _engines[url]


def dispose_engines() -> None:
    for e in _engines.values():
        e.dispose()
    _engines.clear()


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with session_factory(url)() as s:
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
