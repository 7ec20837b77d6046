"""Warm placement: `workers.warm_since`, since when the worker's warm trainer (a standby with
torch imported, worker/standby.py) has been ready to take a one-rank job; null when it has
none ready. Scheduling passes prefer warm idle workers for one-rank jobs
(scheduler/policy.py), so a job does not pay a cold trainer start while a warm slot idles.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Not in batch mode: SQLite adds (and, 3.35+, drops) the column in place, where a rebuild of
# `workers` would fail on the rows that reference it.
def upgrade() -> None:
    op.add_column("workers", sa.Column("warm_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "warm_since")
