"""The scheduler's queue head: a partial index on queued jobs in pass order.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("state = 'queued'")


def upgrade() -> None:
    # (priority DESC, created_at, id) is exactly the scan's ORDER BY: a LIMIT reads the
    # head of the queue off the index instead of sorting every queued job.
    op.create_index(
        "ix_jobs_queued_order",
        "jobs",
        [sa.text("priority DESC"), "created_at", "id"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_order", table_name="jobs")
