"""Metric rows: batched, idempotent ingest on (job, name, step) (the points themselves are
written by store/ingest.py), the rollup blocks, and the queries behind the loss-curve
routes."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session

from torchyard.store.ingest import (
    NAMES_PER_STATEMENT,
    Point,
    insert_new,
    split_new,
    write_points,
)
from torchyard.store.models import Metric, MetricBlock

# Rollup levels (steps per block), finest first: see store.models.MetricBlock.
BLOCK_LEVELS = (64, 4096)

# Recompute the finest blocks touched by a batch from the points themselves, and each coarser
# level from the level below, so a replayed (updated) point corrects its rollups too. One
# statement per level for every series of the batch: `spans` (name, lo, hi) are the
# half-open ranges of steps (finest level) or of finer blocks (coarser levels) to redo.
_BLOCKS_FROM_POINTS_SQL = """
WITH spans(name, lo, hi) AS (VALUES {spans})
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT m.job_id, m.name, :level, m.step / :level, MIN(m.value), MAX(m.value), MAX(m.step),
       COUNT(*)
FROM spans s JOIN metrics m ON m.name = s.name AND m.step >= s.lo AND m.step < s.hi
WHERE m.job_id = :job
GROUP BY m.job_id, m.name, m.step / :level
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""
_BLOCKS_FROM_BLOCKS_SQL = """
WITH spans(name, lo, hi) AS (VALUES {spans})
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT b.job_id, b.name, :level, b.block / :ratio, MIN(b.vmin), MAX(b.vmax),
       MAX(b.last_step), SUM(b.n)
FROM spans s JOIN metric_blocks b
    ON b.name = s.name AND b.level = :finer AND b.block >= s.lo AND b.block < s.hi
WHERE b.job_id = :job
GROUP BY b.job_id, b.name, b.block / :ratio
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""


def ingest_metrics(session: Session, job_id: str, rows: Iterable[dict[str, Any]]) -> int:
    """Insert-or-update metric rows (keys: name, step, epoch, value, time) and their
    rollups, in the session's transaction (store/ingest.py writes the points: new ones
    inserted and merged into their blocks, replayed ones upserted and their blocks redone).

    A replay after resume, or a batch delivered twice, leaves one row per
    (job, name, step) holding the latest value. Returns the number of rows sent.
    """
    # One pass: types as stored, and within the batch the last row of a key wins (ON
    # CONFLICT cannot touch a row twice); keys keep their first position.
    dedup: dict[tuple[str, int], Point] = {}
    for r in rows:
        name, step, epoch = r["name"], int(r["step"]), r.get("epoch")
        dedup[name, step] = (
            name,
            step,
            None if epoch is None else float(epoch),
            float(r["value"]),
            float(r["time"]),
        )
    points = list(dedup.values())
    new, replayed = split_new(session, job_id, points)
    insert_new(session, job_id, new, BLOCK_LEVELS)
    # After the merge: a block holding new and replayed points is then redone from all.
    write_points(session, job_id, replayed, upsert=True)
    _update_blocks(session, job_id, replayed)
    return len(points)


def _redo_blocks(
    session: Session, sql: str, spans: dict[str, tuple[int, int]], **params: Any
) -> None:
    """Run a rollup statement over `spans` (bound as parameters, never inlined), at most
    NAMES_PER_STATEMENT series per statement: its size never grows with a batch's names."""
    items = list(spans.items())
    for lo in range(0, len(items), NAMES_PER_STATEMENT):
        chunk = items[lo : lo + NAMES_PER_STATEMENT]
        values = ", ".join(f"(:n{i}, :lo{i}, :hi{i})" for i in range(len(chunk)))
        bound = dict(params)
        for i, (name, (first, last)) in enumerate(chunk):
            bound.update({f"n{i}": name, f"lo{i}": first, f"hi{i}": last})
        session.execute(text(sql.format(spans=values)), bound)


def _update_blocks(
    session: Session, job_id: str, points: Sequence[Point | tuple[str, int]]
) -> None:
    """Redo the blocks (every level) covering each series' step range in `points`
    (tuples starting with name and step)."""
    steps: dict[str, tuple[int, int]] = {}
    for name, step, *_ in points:
        lo, hi = steps.get(name, (step, step))
        steps[name] = (min(lo, step), max(hi, step))
    finest = BLOCK_LEVELS[0]
    # Whole blocks: a block is recomputed from all its points, not just the new ones. Steps
    # are optimizer steps, never negative.
    blocks = {
        name: (max(lo, 0) // finest, hi // finest + 1)
        for name, (lo, hi) in steps.items()
        if hi >= 0
    }
    if not blocks:
        return
    in_steps = {n: (lo * finest, hi * finest) for n, (lo, hi) in blocks.items()}
    _redo_blocks(session, _BLOCKS_FROM_POINTS_SQL, in_steps, job=job_id, level=finest)
    finer = finest
    for level in BLOCK_LEVELS[1:]:
        ratio = level // finer
        in_finer = {n: ((lo // ratio) * ratio, (hi // ratio + 1) * ratio) for n, (lo, hi) in blocks.items()}  # fmt: skip
        _redo_blocks(session, _BLOCKS_FROM_BLOCKS_SQL, in_finer,
                     job=job_id, level=level, ratio=ratio, finer=finer)  # fmt: skip
        blocks = {n: (lo // ratio, hi // ratio + 1) for n, (lo, hi) in blocks.items()}
        finer = level


# --- queries -------------------------------------------------------------------------------

# Distinct metric names of a job by a loose index scan over (job_id, name, step): one index
# probe per name instead of a scan of every row (a job may hold millions of points).
_NAMES_SQL = """
WITH RECURSIVE names(name) AS (
    SELECT MIN(name) FROM metrics WHERE job_id = :job
    UNION ALL
    SELECT (SELECT MIN(m.name) FROM metrics m WHERE m.job_id = :job AND m.name > names.name)
    FROM names WHERE names.name IS NOT NULL
)
"""

# One point per bucket of `width` steps: the last (step, value) of the bucket, and the
# bucket's min and max, so a spike between two kept points still shows. `src` yields
# (start step, min, max, last step) rows: points themselves, or rollup blocks whose
# level divides `width` (buckets are then whole blocks). The last value is one unique-index
# probe per bucket (a correlated subquery, so no join plan can go wrong on stale stats).
_BUCKETS_SQL = """
WITH src AS ({src}),
b AS (
    SELECT (s - :lo) / :width AS bucket, MIN(vmin) AS vmin, MAX(vmax) AS vmax,
           MAX(last_step) AS last_step
    FROM src
    GROUP BY (s - :lo) / :width
)
SELECT b.last_step,
       (SELECT m.value FROM metrics m
        WHERE m.job_id = :job AND m.name = :name AND m.step = b.last_step) AS value,
       b.vmin, b.vmax
FROM b
ORDER BY b.last_step
"""
_POINTS_SRC = """
SELECT step AS s, value AS vmin, value AS vmax, step AS last_step FROM metrics
WHERE job_id = :job AND name = :name AND step >= :p0 AND step < :p1
"""
# The points after the last whole block of a range (its cut tail).
_TAIL_SRC = """
SELECT step AS s, value AS vmin, value AS vmax, step AS last_step FROM metrics
WHERE job_id = :job AND name = :name AND step >= :t0 AND step <= :hi
"""
_BLOCKS_SRC = """
SELECT block * :level AS s, vmin, vmax, last_step FROM metric_blocks
WHERE job_id = :job AND name = :name AND level = :level AND block >= :first_block
    AND block < :last_block
"""
# Steps are stored as 64-bit integers; these bound any range.
NO_LOWER, NO_UPPER = -(2**62), 2**62


def metric_names(session: Session, job_id: str, limit: int | None = None) -> list[str]:
    """The job's distinct metric names, in order; the first `limit` only when given (the
    worker reads one more than a job may hold, to know it is full)."""
    sql = _NAMES_SQL + "SELECT name FROM names WHERE name IS NOT NULL ORDER BY name"
    params: dict[str, Any] = {"job": job_id}
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = limit
    return [r[0] for r in session.execute(text(sql), params)]


def _raw_series(
    session: Session,
    job_id: str,
    name: str,
    after_step: int,
    limit: int | None = None,
    max_step: int = NO_UPPER,
    with_time: bool = False,
) -> dict[str, list[Any]]:
    q = (
        select(Metric.step, Metric.value, *([Metric.time] if with_time else []))
        .where(
            Metric.job_id == job_id,
            Metric.name == name,
            Metric.step > after_step,
            Metric.step <= max_step,
        )
        .order_by(Metric.step)
    )
    rows = session.execute(q if limit is None else q.limit(limit)).all()
    out: dict[str, list[Any]] = {"steps": [int(r[0]) for r in rows], "values": [r[1] for r in rows]}
    if with_time:
        out["times"] = [r[2] for r in rows]
    return out


def point_rows(
    session: Session,
    job_id: str,
    name: str,
    *,
    after_step: int | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
    limit: int,
) -> list[tuple[int, float | None, float, float]]:
    """One page of a series' raw points in step order: (step, epoch, value, time), at most
    `limit`, after `after_step` and within [min_step, max_step] (an export pages on the last
    step it got)."""
    after, until = _range(after_step, min_step, max_step)
    q = (
        select(Metric.step, Metric.epoch, Metric.value, Metric.time)
        .where(
            Metric.job_id == job_id,
            Metric.name == name,
            Metric.step > after,
            Metric.step <= until,
        )
        .order_by(Metric.step)
        .limit(limit)
    )
    return [(int(r[0]), r[1], r[2], r[3]) for r in session.execute(q)]


def _first_last(
    session: Session, job_id: str, name: str, lo_bound: int, hi_bound: int
) -> tuple[int, int] | None:
    """The first and last recorded steps within [lo_bound, hi_bound]: two index probes
    (MIN and MAX together may scan every point)."""
    where = (
        Metric.job_id == job_id,
        Metric.name == name,
        Metric.step >= lo_bound,
        Metric.step <= hi_bound,
    )
    first = select(Metric.step).where(*where).order_by(Metric.step).limit(1)
    last = select(Metric.step).where(*where).order_by(Metric.step.desc()).limit(1)
    lo, hi = session.execute(select(first.scalar_subquery(), last.scalar_subquery())).one()
    return None if lo is None else (int(lo), int(hi))


def _bucket_plan(lo: int, hi: int, max_points: int, whole_tail: bool) -> tuple[str, dict[str, Any]]:
    """The bucket statement's source and parameters for the recorded steps lo..hi: points
    alone, or whole rollup blocks inside the range with the points of its cut ends.
    `whole_tail`: nothing is recorded after `hi`, so the block holding it is whole too."""
    width = max(1, -(-(hi - lo + 1) // max_points))  # ceil: at most max_points buckets
    level = max((lv for lv in BLOCK_LEVELS if lv <= width and lo >= 0), default=1)
    if level == 1:
        return _POINTS_SRC, {"lo": lo, "width": width, "p0": lo, "p1": hi + 1}
    # Buckets made of whole blocks: the grid starts at a block boundary and its width is a
    # multiple of the level; the ends of the range cut by its bounds come from points.
    grid = (lo // level) * level
    width = level * -(-(hi - grid + 1) // (max_points * level))
    first_block = -(-lo // level)  # the first block that starts at or after lo
    last_block = hi // level + 1 if whole_tail else (hi + 1) // level  # exclusive
    if first_block >= last_block:  # no whole block inside: fewer than 2 levels of points
        return _POINTS_SRC, {"lo": grid, "width": width, "p0": lo, "p1": hi + 1}
    src = _POINTS_SRC + " UNION ALL " + _BLOCKS_SRC + " UNION ALL " + _TAIL_SRC
    params = {"lo": grid, "width": width, "level": level, "first_block": first_block,
              "last_block": last_block, "p0": lo, "p1": first_block * level,
              "t0": last_block * level, "hi": hi}  # fmt: skip
    return src, params


def _downsampled_series(
    session: Session,
    job_id: str,
    name: str,
    after_step: int,
    max_points: int,
    max_step: int = NO_UPPER,
) -> dict[str, list[Any]]:
    bounds = _first_last(session, job_id, name, after_step + 1, max_step)
    if bounds is None:
        return {"steps": [], "values": [], "min": [], "max": []}
    lo, hi = bounds
    src, params = _bucket_plan(lo, hi, max_points, whole_tail=max_step >= NO_UPPER)
    params.update(job=job_id, name=name)
    rows = session.execute(text(_BUCKETS_SQL.format(src=src)), params).all()
    return {
        "steps": [int(r[0]) for r in rows],
        "values": [r[1] for r in rows],
        "min": [r[2] for r in rows],
        "max": [r[3] for r in rows],
    }


def _range(after_step: int | None, min_step: int | None, max_step: int | None) -> tuple[int, int]:
    """(the step points must be after, the last step they may have)."""
    after = NO_LOWER if after_step is None else after_step
    if min_step is not None:
        after = max(after, min_step - 1)
    return after, NO_UPPER if max_step is None else max_step


def query_series(
    session: Session,
    job_id: str,
    *,
    names: list[str] | None = None,
    after_step: int | None = None,
    max_points: int | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
) -> dict[str, dict[str, list[Any]]]:
    """Curves of a job: `{name: {"steps": [...], "values": [...]}}`, steps ascending, only
    steps after `after_step` and within [min_step, max_step]. With `max_points` each curve
    has at most that many points (one per bucket of steps within that range: the bucket's
    last point) plus per-point `min` and `max`. Names asked for but never recorded come
    back as empty series."""
    wanted = names if names else metric_names(session, job_id)
    after, until = _range(after_step, min_step, max_step)
    out: dict[str, dict[str, list[Any]]] = {}
    for name in wanted:
        if max_points is None:
            out[name] = _raw_series(session, job_id, name, after, max_step=until)
        else:
            out[name] = _downsampled_series(session, job_id, name, after, max_points, until)
    return out


class Page(NamedTuple):
    series: dict[str, dict[str, list[Any]]]
    next_after_step: int | None  # None: every curve is complete
    capped: bool  # the total bound, not `limit`, set where the curves were cut


def query_page(
    session: Session,
    job_id: str,
    *,
    names: list[str] | None = None,
    after_step: int | None = None,
    limit: int,
    total: int | None = None,
    min_step: int | None = None,
    max_step: int | None = None,
    with_time: bool = False,
) -> Page:
    """Raw curves within [min_step, max_step], at most `limit` points per curve and `total`
    points in all, and the step to page on from (pass it back as `after_step`). All curves
    are cut at the same step, so paging returns each point exactly once.
    `with_time`: each curve's `times` too (Unix seconds of each point).

    The total is shared in two rounds: each curve first reads its even share; what the
    curves that ended within it left over is then shared by the others (one long curve
    among 999 short ones still gets most of a page)."""
    wanted = names if names else metric_names(session, job_id)
    after, until = _range(after_step, min_step, max_step)
    total = limit * len(wanted) if total is None else total
    per = min(limit, max(1, total // max(1, len(wanted))))

    def read(name: str, n: int) -> dict[str, list[Any]]:
        return _raw_series(session, job_id, name, after, n + 1, until, with_time)

    out = {n: read(n, per) for n in wanted}
    long = [n for n, c in out.items() if len(c["steps"]) > per]
    if long and per < limit:
        ended = sum(len(c["steps"]) for n, c in out.items() if len(c["steps"]) <= per)
        more = min(limit, (total - ended) // len(long))
        if more > per:
            out.update({n: read(n, more) for n in long})
            per = more
            long = [n for n in long if len(out[n]["steps"]) > per]
    if not long:
        return Page(out, None, False)
    cut = min(out[n]["steps"][per - 1] for n in long)
    for c in out.values():
        keep = bisect.bisect_right(c["steps"], cut)
        for k in c:
            c[k] = c[k][:keep]
    return Page(out, cut, per < limit)


def rebuild_blocks(session: Session, job_id: str) -> None:
    """Recompute every rollup block of a job from its points (after a bulk load that
    bypassed ingest_metrics, or to repair)."""
    session.execute(delete(MetricBlock).where(MetricBlock.job_id == job_id))
    for name in metric_names(session, job_id):
        lo, hi = session.execute(
            select(func.min(Metric.step), func.max(Metric.step)).where(
                Metric.job_id == job_id, Metric.name == name
            )
        ).one()
        _update_blocks(session, job_id, [(name, int(lo)), (name, int(hi))])
