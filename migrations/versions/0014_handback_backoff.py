"""Hand-back backoff: `jobs.hold_until`, until when a queued job that was handed back again
and again (a storage fault, a stopping worker, a trainer stopped from outside) waits before
a scheduling pass may start it (store/lifecycle.py: `handback_delay_s`). Null: no wait.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Not in batch mode: SQLite adds (and, 3.35+, drops) the column in place, where a rebuild of
# `jobs` would fail on the rows that reference it (as migration 0007's `sweep_id`).
def upgrade() -> None:
    op.add_column("jobs", sa.Column("hold_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "hold_until")
