"""Each user's sandbox uid (store/sandboxuids.py, worker/launch_sandbox.py): a root worker
runs a user's trainers as that host uid, so kernel keyrings, signals, files and /proc are
apart between users. `sandbox_uids` maps a user to a uid, the uid unique: the unique
constraint is what makes two workers' allocations at once safe (the loser retries).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sandbox_uids",
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id"), primary_key=True),
        sa.Column("uid", sa.Integer(), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sandbox_uids")
