"""Hyperparameter sweeps: the `sweeps` and `sweep_trials` tables, and `jobs.sweep_id` (the
sweep a trial job belongs to). Optuna's own tables are not here: they live in their own
PostgreSQL schema or SQLite file (store/sweeps.py: `optuna_url`), made by Optuna.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("metric", sa.String(length=100), nullable=False),
        sa.Column("mode", sa.String(length=8), nullable=False),
        sa.Column("max_trials", sa.Integer(), nullable=False),
        sa.Column("parallel", sa.Integer(), nullable=False),
        sa.Column("sampler", sa.String(length=16), nullable=False),
        sa.Column("pruner", sa.String(length=16), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["owner_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sweeps_owner_created", "sweeps", ["owner_id", "created_at"])
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sweep_id", "number", name="uq_sweep_trials_sweep_number"),
    )
    op.create_index("ix_sweep_trials_job_id", "sweep_trials", ["job_id"])
    op.create_index(
        "ix_sweep_trials_open",
        "sweep_trials",
        ["sweep_id"],
        postgresql_where=sa.text("outcome IS NULL"),
        sqlite_where=sa.text("outcome IS NULL"),
    )
    # A plain ADD COLUMN (no foreign key): SQLite rebuilds no table for it.
    op.add_column("jobs", sa.Column("sweep_id", sa.String(length=32), nullable=True))
    op.create_index("ix_jobs_sweep_id", "jobs", ["sweep_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_id", table_name="jobs")
    # Not in batch mode: SQLite (3.35+) drops the column in place, where a rebuild of the
    # table would lose its partial indexes' DESC.
    op.drop_column("jobs", "sweep_id")
    op.drop_index("ix_sweep_trials_open", table_name="sweep_trials")
    op.drop_index("ix_sweep_trials_job_id", table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_index("ix_sweeps_owner_created", table_name="sweeps")
    op.drop_table("sweeps")
