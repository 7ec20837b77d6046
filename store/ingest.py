"""Writing a batch of metric points, in the caller's transaction: on PostgreSQL one
statement for the new points and their rollups (the batch as binary arrays, `unnest`ed),
on SQLite prepared statements run by the driver's `executemany`. A SQLAlchemy-built
multi-row `INSERT … VALUES` spent most of a flush building and binding parameters, and
text array literals a repr() per number (bench/ingest_bench.py).

A batch splits in two. Points past the newest step of their series (the usual case: a
trainer moving forward) are new for certain: a plain INSERT, the cheapest write, and their
rollup blocks are merged from the batch alone (min of mins, sum of counts), without reading
points back. The rest (a replay after resume, a batch sent again after a crash) are
upserted, the latest value winning, and store/metrics.py recomputes their blocks from the
points. Either way one row per (job, name, step) remains and a batch sent twice adds
nothing. A point that is "new" but already there (another writer of the job between the
two statements; fencing makes that impossible) fails the INSERT, never doubles a row.

No statement's shape depends on how many series a batch holds beyond a fixed chunk
(`NAMES_PER_STATEMENT`): a batch of 3,000 names once built a 3,000-column SELECT that both
databases refuse. A batch the store refuses for what it holds (`refused_by_store`: a value
out of range, a limit of the database) would be refused again: the worker sets it aside
rather than retrying it; a lost connection is retried."""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Sequence
from typing import Any

from psycopg import adapters
from psycopg.abc import Buffer
from psycopg.adapt import Dumper
from psycopg.pq import Format
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres

Point = tuple[str, int, float | None, float, float]  # name, step, epoch, value, time
Block = tuple[str, int, int, float, float, int, int]  # name, level, block, vmin, vmax, last, n
_POINT_KINDS, _BLOCK_KINDS = "qddd", "iqddqi"  # their numbers' SQL types (see `_array`)

# Rows in the order given (the SSE feed pages on the id), one per key: the caller dedups.
# Names go as a short array indexed by each row (a batch has a few series); numbers as
# binary arrays packed here (`_array`). `{p}` prefixes the parameters, so that points and
# blocks can share a statement.
_PG_POINTS = """
INSERT INTO metrics (job_id, name, step, epoch, value, "time")
SELECT :job, (CAST(:{p}names AS varchar[]))[p.k], p.step, p.epoch, p.value, p.t
FROM unnest(
    CAST(:{p}ks AS int[]), CAST(:{p}c1 AS bigint[]), CAST(:{p}c2 AS float8[]),
    CAST(:{p}c3 AS float8[]), CAST(:{p}c4 AS float8[])
) WITH ORDINALITY AS p(k, step, epoch, value, t, i)
ORDER BY p.i
"""
_SQLITE_POINTS = """
INSERT INTO metrics (job_id, name, step, epoch, value, "time") VALUES (?, ?, ?, ?, ?, ?)
"""
_UPSERT_POINTS = """
ON CONFLICT (job_id, name, step) DO UPDATE SET
    epoch = excluded.epoch, value = excluded.value, "time" = excluded."time"
"""
_PG_BLOCKS = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT :job, (CAST(:{p}names AS varchar[]))[b.k], b.level, b.block, b.vmin, b.vmax, b.last,
       b.n
FROM unnest(
    CAST(:{p}ks AS int[]), CAST(:{p}c1 AS int[]), CAST(:{p}c2 AS bigint[]),
    CAST(:{p}c3 AS float8[]), CAST(:{p}c4 AS float8[]), CAST(:{p}c5 AS bigint[]),
    CAST(:{p}c6 AS int[])
) AS b(k, level, block, vmin, vmax, last, n)
"""
_SQLITE_BLOCKS = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
# Merge a batch's own aggregate of new points into a block (portable: no LEAST/GREATEST).
_MERGE_BLOCKS = """
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = CASE WHEN excluded.vmin < metric_blocks.vmin
                THEN excluded.vmin ELSE metric_blocks.vmin END,
    vmax = CASE WHEN excluded.vmax > metric_blocks.vmax
                THEN excluded.vmax ELSE metric_blocks.vmax END,
    last_step = CASE WHEN excluded.last_step > metric_blocks.last_step
                     THEN excluded.last_step ELSE metric_blocks.last_step END,
    n = metric_blocks.n + excluded.n
"""


class _Int4Array(bytes):
    """An int[] in PostgreSQL's binary array format (psycopg sends it as is)."""


class _Int8Array(bytes):
    """A bigint[] in PostgreSQL's binary array format."""


class _Float8Array(bytes):
    """A float8[] in PostgreSQL's binary array format."""


def _register(cls: type[bytes], array_oid: int) -> None:
    """psycopg sends a `cls` as is, in binary format, typed `array_oid`."""

    class ArrayDumper(Dumper):
        format = Format.BINARY
        oid = array_oid

        def dump(self, obj: Buffer) -> Buffer:
            return obj

    adapters.register_dumper(cls, ArrayDumper)


_register(_Int4Array, 1007)
_register(_Int8Array, 1016)
_register(_Float8Array, 1022)
# kind (a struct code) -> (array class, element oid)
_KINDS: dict[str, tuple[type[bytes], int]] = {
    "i": (_Int4Array, 23),
    "q": (_Int8Array, 20),
    "d": (_Float8Array, 701),
}
_HEADER = struct.Struct(">iiiii")  # dimensions, has NULLs, element oid, length, lower bound


def _array(values: Sequence[Any], kind: str) -> bytes:
    """`values` (int4 "i", int8 "q" or float8 "d") as a binary array: one struct.pack for
    the whole column, where a text literal took a repr() per number (~0.5 µs each) and the
    server a parse. Each element is its byte length, then its bytes (NULL: length -1)."""
    cls, oid = _KINDS[kind]
    n, size = len(values), struct.calcsize(kind)
    if None not in values:
        args = [size] * (2 * n)
        args[1::2] = values
        body = struct.pack(f">{('i' + kind) * n}", *args)
        return cls(_HEADER.pack(1, 0, oid, n, 1) + body)
    fmt = "".join("i" if v is None else "i" + kind for v in values)
    args = [x for v in values for x in ((-1,) if v is None else (size, v))]
    return cls(_HEADER.pack(1, 1, oid, n, 1) + struct.pack(f">{fmt}", *args))


def _pg_params(prefix: str, rows: Sequence[tuple[Any, ...]], kinds: str) -> dict[str, Any]:
    """The parameters of `rows` (name first, then numbers of `kinds`, see `_array`) for a
    statement whose placeholders carry `prefix`: names once each, a 1-based index into
    them per row, an array per column. Whole columns at a time: per-row Python dominates."""
    columns = list(zip(*rows, strict=True))
    index = {name: i for i, name in enumerate(dict.fromkeys(columns[0]), 1)}
    params: dict[str, Any] = {
        f"{prefix}names": list(index),
        f"{prefix}ks": _array(list(map(index.__getitem__, columns[0])), "i"),
    }
    for i, (column, kind) in enumerate(zip(columns[1:], kinds, strict=True), 1):
        params[f"{prefix}c{i}"] = _array(column, kind)
    return params


def _sqlite_many(session: Session, sql: str, job_id: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """`sql` once per row through the driver's `executemany`, in the session's transaction:
    its own DBAPI connection (BEGIN IMMEDIATE, store/db.py), so the rows commit or roll back
    with the rest of the batch."""
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    cur = dbapi.cursor()
    try:
        cur.executemany(sql, [(job_id, *r) for r in rows])
    finally:
        cur.close()


def write_points(session: Session, job_id: str, points: Sequence[Point], *, upsert: bool) -> None:
    """Insert `points` (at most one per (name, step)) for `job_id`; with `upsert`, a point
    already there takes the new values."""
    if not points:
        return
    tail = _UPSERT_POINTS if upsert else ""
    if is_postgres(session):
        params = {"job": job_id, **_pg_params("", points, _POINT_KINDS)}
        session.execute(text(_PG_POINTS.format(p="") + tail), params)
    else:
        _sqlite_many(session, _SQLITE_POINTS + tail, job_id, points)


def insert_new(
    session: Session, job_id: str, points: Sequence[Point], levels: Sequence[int]
) -> None:
    """Insert points never recorded before (a plain INSERT: one already there fails it) and
    fold them into their rollup blocks: one statement on PostgreSQL (the points' INSERT in
    a CTE; the blocks are aggregated here, so the statement reads no table)."""
    if not points:
        return
    blocks = _aggregate(points, levels)
    if is_postgres(session):
        sql = _PG_POINTS.format(p="p_")
        params = {"job": job_id, **_pg_params("p_", points, _POINT_KINDS)}
        if blocks:
            sql = f"WITH points AS ({sql})" + _PG_BLOCKS.format(p="b_") + _MERGE_BLOCKS
            params.update(_pg_params("b_", blocks, _BLOCK_KINDS))
        session.execute(text(sql), params)
        return
    _sqlite_many(session, _SQLITE_POINTS, job_id, points)
    if blocks:
        _sqlite_many(session, _SQLITE_BLOCKS + _MERGE_BLOCKS, job_id, blocks)


NAMES_PER_STATEMENT = 500  # series one statement looks up: far below every database's limits
# One row per name (never one column per name): the newest step of each, one index probe
# each (ORDER BY … LIMIT 1, not MAX: on stale statistics MAX may read the whole series).
_NEWEST_SQL = """
WITH wanted(name) AS (VALUES {names})
SELECT w.name, (SELECT m.step FROM metrics m WHERE m.job_id = :job AND m.name = w.name
                ORDER BY m.step DESC LIMIT 1)
FROM wanted w
"""


def newest_steps(session: Session, job_id: str, names: Sequence[str]) -> dict[str, int | None]:
    """The newest recorded step of each series (None: none yet), `NAMES_PER_STATEMENT`
    names per statement."""
    out: dict[str, int | None] = {}
    for lo in range(0, len(names), NAMES_PER_STATEMENT):
        chunk = names[lo : lo + NAMES_PER_STATEMENT]
        values = ", ".join(f"(:n{i})" for i in range(len(chunk)))
        params: dict[str, Any] = {f"n{i}": n for i, n in enumerate(chunk)}
        rows = session.execute(text(_NEWEST_SQL.format(names=values)), {"job": job_id, **params})
        out.update((name, None if step is None else int(step)) for name, step in rows)
    return {n: out.get(n) for n in names}


# SQLSTATE classes of a refusal for what a statement holds: data exception, integrity
# constraint, syntax or access rule, program limit exceeded (too many columns, too complex).
_REFUSED_CLASSES = ("22", "23", "42", "54")
# SQLite's words for its limits (it has no SQLSTATE): too many columns, terms or variables,
# a string or blob too big, an expression tree too large, an integer overflow.
_SQLITE_LIMITS = ("too many", "too big", "too large", "overflow", "maximum depth")
# What building a batch's parameters raises for a value no column can hold.
_BAD_VALUES = (OverflowError, ValueError, TypeError, struct.error)


def refused_by_store(e: BaseException) -> bool:
    """Whether the store refused a write for what it holds, so that sending it again would
    be refused again (set it aside): False for a lost connection, a timeout, a lock or a
    serialisation conflict, which a retry outlives."""
    if isinstance(e, sa_exc.DBAPIError):
        if e.connection_invalidated:
            return False
        state = getattr(e.orig, "sqlstate", None)
        if isinstance(state, str) and state:
            return state[:2] in _REFUSED_CLASSES
        if isinstance(e, sa_exc.OperationalError):
            return any(m in str(e.orig).lower() for m in _SQLITE_LIMITS)
        return isinstance(e, sa_exc.IntegrityError | sa_exc.DataError | sa_exc.ProgrammingError)
    if isinstance(e, sa_exc.StatementError):  # a parameter the driver could not bind
        return isinstance(e.orig, _BAD_VALUES)
    if isinstance(e, sa_exc.SQLAlchemyError):
        return False
    if isinstance(e, sqlite3.Error):  # raised by the driver itself (`_sqlite_many`)
        return not isinstance(e, sqlite3.OperationalError) or any(
            m in str(e).lower() for m in _SQLITE_LIMITS
        )
    return isinstance(e, _BAD_VALUES)


def split_new(
    session: Session, job_id: str, points: Sequence[Point]
) -> tuple[list[Point], list[Point]]:
    """(points past their series' newest recorded step, the others)."""
    newest = newest_steps(session, job_id, list(dict.fromkeys(p[0] for p in points)))
    if all(top is None for top in newest.values()):  # a job's first batch
        return list(points), []
    new: list[Point] = []
    old: list[Point] = []
    for p in points:
        top = newest[p[0]]
        (new if top is None or p[1] > top else old).append(p)
    return new, old


def _aggregate(points: Sequence[Point], levels: Sequence[int]) -> list[Block]:
    """The blocks of `points` at each level (finest first, each a multiple of the one
    before), from steps 0 on: blocks never cover negative steps (store/metrics.py)."""
    first = levels[0]
    finest: dict[tuple[str, int], list[Any]] = {}
    for name, step, _epoch, value, _time in points:
        if step < 0:
            continue
        a = finest.get((name, step // first))
        if a is None:
            finest[(name, step // first)] = [value, value, step, 1]
            continue
        # Comparisons, not min()/max(): a call per point costs more than the rest.
        if value < a[0]:
            a[0] = value
        elif value > a[1]:
            a[1] = value
        if step > a[2]:
            a[2] = step
        a[3] += 1
    out = [(name, first, block, *a) for (name, block), a in finest.items()]
    for level in levels[1:]:
        coarse: dict[tuple[str, int], list[Any]] = {}
        for (name, block), (vmin, vmax, last, n) in finest.items():
            key = (name, block * first // level)
            a = coarse.setdefault(key, [vmin, vmax, last, 0])
            a[0], a[1], a[2], a[3] = min(a[0], vmin), max(a[1], vmax), max(a[2], last), a[3] + n
        out += [(name, level, block, *a) for (name, block), a in coarse.items()]
    return out
