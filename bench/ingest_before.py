"""The metric flush as it was before issue 9, frozen for bench/ingest_bench.py's "before"
run: `before_write` is EventRecorder.write of then (fence; points; rollups; job version or
progress; events offset: six statements for a batch of new points on PostgreSQL), and
`before_ingest_metrics` store/metrics.py's ingest_metrics with store/ingest.py of then
(copied below, unchanged but for names)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import text, update
from sqlalchemy.orm import Session

from torchyard.store.dialect import is_postgres
from torchyard.store.jobs import bump_version, set_progress
from torchyard.store.lifecycle import fence, mark_started
from torchyard.store.metrics import BLOCK_LEVELS, _update_blocks
from torchyard.store.models import Attempt
from torchyard.worker.events import EventRecorder

Row = dict[str, Any]  # name, step, epoch, value, time
Block = tuple[str, int, int, float, float, int, int]  # name, level, block, vmin, vmax, last, n

# Rows in the order given (the SSE feed pages on the id), one per key: the caller dedups.
# Names go as a short array indexed by each row (a batch has a few series); numbers as
# array literals, which the server parses faster than the driver adapts lists element by
# element.
_PG_POINTS = """
INSERT INTO metrics (job_id, name, step, epoch, value, "time")
SELECT :job, (CAST(:names AS varchar[]))[p.k], p.step, p.epoch, p.value, p.t
FROM unnest(
    CAST(:ks AS int[]), CAST(:c1 AS bigint[]), CAST(:c2 AS float8[]),
    CAST(:c3 AS float8[]), CAST(:c4 AS float8[])
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
SELECT :job, (CAST(:names AS varchar[]))[b.k], b.level, b.block, b.vmin, b.vmax, b.last, b.n
FROM unnest(
    CAST(:ks AS int[]), CAST(:c1 AS int[]), CAST(:c2 AS bigint[]), CAST(:c3 AS float8[]),
    CAST(:c4 AS float8[]), CAST(:c5 AS bigint[]), CAST(:c6 AS int[])
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


def _array(values: Sequence[Any]) -> str:
    """A PostgreSQL array literal of numbers (repr round-trips a float exactly)."""
    if None in values:
        return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"
    return "{" + ",".join(map(repr, values)) + "}"


def _insert(
    session: Session, sql: tuple[str, str], job_id: str, rows: Sequence[tuple[Any, ...]]
) -> None:
    """Insert `rows` (name first, then numbers) with `sql`, its (PostgreSQL, SQLite) forms,
    as one statement on PostgreSQL and one `executemany` on SQLite, in the session's
    transaction."""
    if not rows:
        return
    if is_postgres(session):
        index: dict[str, int] = {}
        params: dict[str, Any] = {
            "job": job_id,
            "ks": _array([index.setdefault(r[0], len(index) + 1) for r in rows]),  # 1-based
        }
        for i, column in enumerate(zip(*rows, strict=True)):
            if i:
                params[f"c{i}"] = _array(column)
        session.execute(text(sql[0]), {**params, "names": list(index)})
        return
    # The session's own DBAPI connection: the statement joins its transaction (BEGIN
    # IMMEDIATE, store/db.py), so the batch commits or rolls back with the offset.
    dbapi = session.connection().connection.driver_connection
    assert dbapi is not None
    cur = dbapi.cursor()
    try:
        cur.executemany(sql[1], [(job_id, *r) for r in rows])
    finally:
        cur.close()


def write_points(session: Session, job_id: str, rows: Sequence[Row], *, upsert: bool) -> None:
    """Insert `rows` (at most one per (name, step); numbers as int and float) for `job_id`;
    with `upsert`, a row already there takes the new values."""
    tail = _UPSERT_POINTS if upsert else ""
    _insert(
        session,
        (_PG_POINTS + tail, _SQLITE_POINTS + tail),
        job_id,
        [(r["name"], r["step"], r["epoch"], r["value"], r["time"]) for r in rows],
    )


def newest_steps(session: Session, job_id: str, names: Sequence[str]) -> dict[str, int | None]:
    """The newest recorded step of each series (None: none yet): one index probe each
    (ORDER BY … LIMIT 1, not MAX: on stale statistics MAX may read the whole series)."""
    probes = ", ".join(
        f"(SELECT step FROM metrics WHERE job_id = :job AND name = :n{i}"
        " ORDER BY step DESC LIMIT 1)"
        for i in range(len(names))
    )
    params: dict[str, Any] = {f"n{i}": n for i, n in enumerate(names)}
    row = session.execute(text(f"SELECT {probes}"), {"job": job_id, **params}).one()
    return dict(zip(names, row, strict=True))


def split_new(session: Session, job_id: str, rows: Sequence[Row]) -> tuple[list[Row], list[Row]]:
    """(points past their series' newest recorded step, the others)."""
    newest = newest_steps(session, job_id, list({r["name"]: None for r in rows}))
    new: list[Row] = []
    old: list[Row] = []
    for r in rows:
        top = newest[r["name"]]
        (new if top is None or r["step"] > top else old).append(r)
    return new, old


def _aggregate(rows: Sequence[Row], levels: Sequence[int]) -> list[Block]:
    """The blocks of `rows` at each level (finest first, each a multiple of the one
    before), from steps 0 on: blocks never cover negative steps (store/metrics.py)."""
    finest: dict[tuple[str, int], list[Any]] = {}
    for r in rows:
        step, value = r["step"], r["value"]
        if step < 0:
            continue
        a = finest.get((r["name"], step // levels[0]))
        if a is None:
            finest[(r["name"], step // levels[0])] = [value, value, step, 1]
        else:
            a[0], a[1] = min(a[0], value), max(a[1], value)
            a[2], a[3] = max(a[2], step), a[3] + 1
    out = [(name, levels[0], block, *a) for (name, block), a in finest.items()]
    for level in levels[1:]:
        coarse: dict[tuple[str, int], list[Any]] = {}
        for (name, block), (vmin, vmax, last, n) in finest.items():
            key = (name, block * levels[0] // level)
            a = coarse.setdefault(key, [vmin, vmax, last, 0])
            a[0], a[1], a[2], a[3] = min(a[0], vmin), max(a[1], vmax), max(a[2], last), a[3] + n
        out += [(name, level, block, *a) for (name, block), a in coarse.items()]
    return out


def merge_new_blocks(
    session: Session, job_id: str, rows: Sequence[Row], levels: Sequence[int]
) -> None:
    """Fold points just inserted (never there before) into their rollup blocks."""
    sql = (_PG_BLOCKS + _MERGE_BLOCKS, _SQLITE_BLOCKS + _MERGE_BLOCKS)
    _insert(session, sql, job_id, _aggregate(rows, levels))


def before_ingest_metrics(session: Session, job_id: str, rows: Iterable[dict[str, Any]]) -> int:
    """store/metrics.py's ingest_metrics before issue 9."""
    values = [
        {
            "name": r["name"],
            "step": int(r["step"]),
            "epoch": None if r.get("epoch") is None else float(r["epoch"]),
            "value": float(r["value"]),
            "time": float(r["time"]),
        }
        for r in rows
    ]
    dedup = list({(v["name"], v["step"]): v for v in values}.values())
    new, replayed = split_new(session, job_id, dedup)
    write_points(session, job_id, new, upsert=False)
    merge_new_blocks(session, job_id, new, BLOCK_LEVELS)
    write_points(session, job_id, replayed, upsert=True)
    _update_blocks(session, job_id, [(r["name"], r["step"]) for r in replayed])  # type: ignore[misc]
    return len(dedup)


class BeforeRecorder(EventRecorder):
    """EventRecorder with the flush of before issue 9."""

    def write(self, session: Session) -> None:
        fence(session, self.attempt_id)
        if self.started_pending:
            mark_started(session, self.attempt_id)
        if self.metrics:
            before_ingest_metrics(session, self.job_id, self.metrics)
        for c in self.checkpoints:
            self._write_checkpoint(session, c)
        if self.progress is not None and self.attempt_number is not None:
            set_progress(session, self.job_id, self.attempt_number, self.progress)
        elif self.metrics or self.checkpoints:
            bump_version(session, self.job_id)
        if self.offset is not None:
            set_events_offset(session, self.attempt_id, self.offset)


def set_events_offset(session: Session, attempt_id: int, offset: int) -> None:
    """The pre-change offset write (store/attempts.py had it; fence_flush replaced it)."""
    session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.events_offset < offset)
        .values(events_offset=offset)
        .execution_options(synchronize_session=False)
    )
