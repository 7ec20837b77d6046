"""Cheaper scheduler writes (bench/scheduler_bench.py): `jobs` keeps free space in its pages
(fillfactor 70 on PostgreSQL), so that updates that change no indexed column (pending
reasons, progress, version bumps) are HOT: the new row version stays in its page and no
index is written. Indexes that every write maintained and no query needs are dropped or
made partial: ix_jobs_owner_id (ix_jobs_owner_created starts with owner_id),
ix_jobs_queued_order (the queue is read per owner, ix_jobs_queued_owner_order),
ix_assignments_attempt_id (uq_assignments_attempt_rank starts with attempt_id),
ix_attempts_job_id (uq_attempts_job_number starts with job_id), and the
NULL entries of ix_jobs_sweep_id and ix_attempts_preempted_by (queries look up non-NULL
values only). Rows already there keep their pages until the table is rewritten.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("state = 'queued'")
SWEEP = sa.text("sweep_id IS NOT NULL")
PREEMPTED = sa.text("preempted_by IS NOT NULL")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs SET (fillfactor = 70)")
    op.drop_index("ix_jobs_owner_id", table_name="jobs")
    op.drop_index("ix_jobs_queued_order", table_name="jobs")
    op.drop_index("ix_assignments_attempt_id", table_name="assignments")
    op.drop_index("ix_attempts_job_id", table_name="attempts")
    op.drop_index("ix_jobs_sweep_id", table_name="jobs")
    op.create_index(
        "ix_jobs_sweep_id", "jobs", ["sweep_id"], postgresql_where=SWEEP, sqlite_where=SWEEP
    )
    op.drop_index("ix_attempts_preempted_by", table_name="attempts")
    op.create_index(
        "ix_attempts_preempted_by",
        "attempts",
        ["preempted_by"],
        postgresql_where=PREEMPTED,
        sqlite_where=PREEMPTED,
    )


def downgrade() -> None:
    op.drop_index("ix_attempts_preempted_by", table_name="attempts")
    op.create_index("ix_attempts_preempted_by", "attempts", ["preempted_by"])
    op.drop_index("ix_jobs_sweep_id", table_name="jobs")
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"])
    op.create_index("ix_attempts_job_id", "attempts", ["job_id"])
    op.create_index("ix_assignments_attempt_id", "assignments", ["attempt_id"])
    op.create_index(
        "ix_jobs_queued_order",
        "jobs",
        [sa.text("priority DESC"), "created_at", "id"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )
    op.create_index("ix_jobs_owner_id", "jobs", ["owner_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs RESET (fillfactor)")
