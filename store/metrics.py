"""Metric rows: batched, idempotent ingest on (job, name, step), and the queries behind
the loss-curve routes."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session

from torchyard.store.models import Metric, MetricBlock

INGEST_CHUNK = 500
# Rollup levels (steps per block), finest first: see store.models.MetricBlock.
BLOCK_LEVELS = (64, 4096)

# Recompute the finest blocks touched by a batch from the points themselves, and each coarser
# level from the level below, so a replayed (updated) point corrects its rollups too.
_BLOCKS_FROM_POINTS_SQL = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT job_id, name, :level, step / :level, MIN(value), MAX(value), MAX(step), COUNT(*)
FROM metrics
WHERE job_id = :job AND name = :name AND step >= :lo AND step < :hi
GROUP BY job_id, name, step / :level
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""
_BLOCKS_FROM_BLOCKS_SQL = """
INSERT INTO metric_blocks (job_id, name, level, block, vmin, vmax, last_step, n)
SELECT job_id, name, :level, block / :ratio, MIN(vmin), MAX(vmax), MAX(last_step), SUM(n)
FROM metric_blocks
WHERE job_id = :job AND name = :name AND level = :finer AND block >= :lo AND block < :hi
GROUP BY job_id, name, block / :ratio
ON CONFLICT (job_id, name, level, block) DO UPDATE SET
    vmin = excluded.vmin, vmax = excluded.vmax, last_step = excluded.last_step, n = excluded.n
"""


def _insert(session: Session) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def ingest_metrics(session: Session, job_id: str, rows: Iterable[dict[str, Any]]) -> int:
    """Insert-or-update metric rows (keys: name, step, epoch, value, time).

    A replay after resume, or a batch delivered twice, leaves one row per
    (job, name, step) holding the latest value. Returns the number of rows sent.
    """
    values = [
        {
            "job_id": job_id,
            "name": r["name"],
            "step": int(r["step"]),
            "epoch": r.get("epoch"),
            "value": float(r["value"]),
            "time": float(r["time"]),
        }
        for r in rows
    ]
    # Within one batch the last row of a key wins (ON CONFLICT cannot touch a row twice).
    dedup = list({(v["name"], v["step"]): v for v in values}.values())
    insert = _insert(session)
    for i in range(0, len(dedup), INGEST_CHUNK):
        stmt = insert(Metric).values(dedup[i : i + INGEST_CHUNK])
        stmt = stmt.on_conflict_do_update(
            index_elements=["job_id", "name", "step"],
            set_={
                "epoch": stmt.excluded.epoch,
                "value": stmt.excluded.value,
                "time": stmt.excluded.time,
            },
        )
        session.execute(stmt)
    _update_blocks(session, job_id, dedup)
    return len(dedup)


def _update_blocks(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    spans: dict[str, tuple[int, int]] = {}
    for r in rows:
        lo, hi = spans.get(r["name"], (r["step"], r["step"]))
        spans[r["name"]] = (min(lo, r["step"]), max(hi, r["step"]))
    for name, (lo, hi) in spans.items():
        lo = max(lo, 0)  # steps are optimizer steps, never negative
        if hi < 0:
            continue
        finest = BLOCK_LEVELS[0]
        # Whole blocks: a block is recomputed from all its points, not just the new ones.
        b_lo, b_hi = lo // finest, hi // finest + 1
        session.execute(
            text(_BLOCKS_FROM_POINTS_SQL),
            {
                "job": job_id,
                "name": name,
                "level": finest,
                "lo": b_lo * finest,
                "hi": b_hi * finest,
            },
        )
        finer = finest
        for level in BLOCK_LEVELS[1:]:
            ratio = level // finer
            session.execute(
                text(_BLOCKS_FROM_BLOCKS_SQL),
                {
                    "job": job_id,
                    "name": name,
                    "level": level,
                    "ratio": ratio,
                    "finer": finer,
                    "lo": (b_lo // ratio) * ratio,
                    "hi": (b_hi // ratio + 1) * ratio,
                },
            )
            b_lo, b_hi = b_lo // ratio, b_hi // ratio + 1
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

_LATEST_SQL = (
    _NAMES_SQL
    + """
SELECT n.name, m.step, m.value
FROM names n
JOIN metrics m ON m.job_id = :job AND m.name = n.name
    AND m.step = (SELECT MAX(x.step) FROM metrics x WHERE x.job_id = :job AND x.name = n.name)
ORDER BY n.name
"""
)

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
WHERE job_id = :job AND name = :name AND step > :after AND step < :until
"""
_BLOCKS_SRC = """
SELECT block * :level AS s, vmin, vmax, last_step FROM metric_blocks
WHERE job_id = :job AND name = :name AND level = :level AND block >= :first_block
"""


def metric_names(session: Session, job_id: str) -> list[str]:
    rows = session.execute(
        text(_NAMES_SQL + "SELECT name FROM names WHERE name IS NOT NULL ORDER BY name"),
        {"job": job_id},
    )
    return [r[0] for r in rows]


def latest_metrics(session: Session, job_id: str) -> dict[str, dict[str, Any]]:
    """`{name: {"step", "value"}}`: the newest point of each metric of a job."""
    rows = session.execute(text(_LATEST_SQL), {"job": job_id})
    return {name: {"step": int(step), "value": value} for name, step, value in rows}


def _raw_series(
    session: Session, job_id: str, name: str, after_step: int, limit: int | None = None
) -> dict[str, list[Any]]:
    q = (
        select(Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.name == name, Metric.step > after_step)
        .order_by(Metric.step)
    )
    rows = session.execute(q if limit is None else q.limit(limit)).all()
    return {"steps": [int(r[0]) for r in rows], "values": [r[1] for r in rows]}


def _downsampled_series(
    session: Session, job_id: str, name: str, after_step: int, max_points: int
) -> dict[str, list[Any]]:
    where = (Metric.job_id == job_id, Metric.name == name, Metric.step > after_step)
    # Two index probes (first and last step); MIN and MAX together may scan every point.
    lo, hi = session.execute(
        select(
            select(Metric.step).where(*where).order_by(Metric.step).limit(1).scalar_subquery(),
            select(Metric.step)
            .where(*where)
            .order_by(Metric.step.desc())
            .limit(1)
            .scalar_subquery(),
        )
    ).one()
    if lo is None:
        return {"steps": [], "values": [], "min": [], "max": []}
    lo, hi = int(lo), int(hi)
    width = max(1, -(-(hi - lo + 1) // max_points))  # ceil: at most max_points buckets
    level = max((lv for lv in BLOCK_LEVELS if lv <= width and lo >= 0), default=1)
    params: dict[str, Any] = {"job": job_id, "name": name, "after": after_step}
    if level == 1:
        sql = _BUCKETS_SQL.format(src=_POINTS_SRC)
        params.update(lo=lo, width=width, until=hi + 1)
    else:
        # Buckets made of whole blocks: the grid starts at a block boundary and its width
        # is a multiple of the level; a first block cut by `after_step` comes from points.
        width = level * -(-(hi - (lo // level) * level + 1) // (max_points * level))
        first_block = -(-lo // level)  # the first block that starts at or after lo
        sql = _BUCKETS_SQL.format(src=_POINTS_SRC + " UNION ALL " + _BLOCKS_SRC)
        params.update(
            lo=(lo // level) * level,
            width=width,
            level=level,
            first_block=first_block,
            until=first_block * level,
        )
    rows = session.execute(text(sql), params).all()
    return {
        "steps": [int(r[0]) for r in rows],
        "values": [r[1] for r in rows],
        "min": [r[2] for r in rows],
        "max": [r[3] for r in rows],
    }


def query_series(
    session: Session,
    job_id: str,
    *,
    names: list[str] | None = None,
    after_step: int | None = None,
    max_points: int | None = None,
) -> dict[str, dict[str, list[Any]]]:
    """Curves of a job: `{name: {"steps": [...], "values": [...]}}`, steps ascending, only
    steps after `after_step`. With `max_points` each curve has at most that many points
    (one per bucket of steps: the bucket's last point) plus per-point `min` and `max`.
    Names asked for but never recorded come back as empty series."""
    wanted = names if names else metric_names(session, job_id)
    after = -(2**62) if after_step is None else after_step
    out: dict[str, dict[str, list[Any]]] = {}
    for name in wanted:
        if max_points is None:
            out[name] = _raw_series(session, job_id, name, after)
        else:
            out[name] = _downsampled_series(session, job_id, name, after, max_points)
    return out


def query_page(
    session: Session,
    job_id: str,
    *,
    names: list[str] | None = None,
    after_step: int | None = None,
    limit: int,
) -> tuple[dict[str, dict[str, list[Any]]], int | None]:
    """Raw curves, at most `limit` points per curve, and the step to page on from (pass it
    back as `after_step`), None when every curve is complete. All curves are cut at the
    same step, so paging returns each point exactly once."""
    wanted = names if names else metric_names(session, job_id)
    after = -(2**62) if after_step is None else after_step
    out = {n: _raw_series(session, job_id, n, after, limit + 1) for n in wanted}
    cut = min(
        (c["steps"][limit - 1] for c in out.values() if len(c["steps"]) > limit), default=None
    )
    if cut is None:
        return out, None
    for c in out.values():
        keep = bisect.bisect_right(c["steps"], cut)
        c["steps"], c["values"] = c["steps"][:keep], c["values"][:keep]
    return out, cut


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
        _update_blocks(
            session,
            job_id,
            [{"name": name, "step": int(lo)}, {"name": name, "step": int(hi)}],
        )
