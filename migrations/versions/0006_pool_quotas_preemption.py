"""Sharing the pool: per-user quotas and fair-share weight (`users.max_workers`,
`max_queued`, `share`), `jobs.preemptible`, `attempts.preempted_by` (the job an attempt
is stopped for), and indexes for the fair-share usage read (`attempts.ended_at`) and
the preemptions in flight (`attempts.preempted_by`), and each user's queue head in
pass order (`ix_jobs_queued_owner_order`).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_workers", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("share", sa.Float(), server_default="1", nullable=False))
    # Existing jobs keep the old behaviour's meaning: anything may be preempted unless
    # its spec said otherwise, and no spec could say so before this revision.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("preemptible", sa.Boolean(), server_default=sa.true(), nullable=False)
        )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("preempted_by", sa.String(length=32), nullable=True))
    op.create_index("ix_attempts_ended_at", "attempts", ["ended_at"])
    op.create_index("ix_attempts_preempted_by", "attempts", ["preempted_by"])
    queued = sa.text("state = 'queued'")
    op.create_index(
        "ix_jobs_queued_owner_order",
        "jobs",
        ["owner_id", sa.text("priority DESC"), "created_at", "id"],
        postgresql_where=queued,
        sqlite_where=queued,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_owner_order", table_name="jobs")
    op.drop_index("ix_attempts_preempted_by", table_name="attempts")
    op.drop_index("ix_attempts_ended_at", table_name="attempts")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_column("preempted_by")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("preemptible")
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("share")
        batch_op.drop_column("max_queued")
        batch_op.drop_column("max_workers")
