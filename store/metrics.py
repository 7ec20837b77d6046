"""Metric rows: batched, idempotent ingest on (job, name, step), and the queries behind
the loss-curve routes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from store.models import Metric

INGEST_CHUNK = 500


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
    return len(dedup)
