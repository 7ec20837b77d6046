"""Synchronous successive halving (`pruner: halving`, store/pruning.py): a trial waits at
a rung with its worker freed. `sweep_trials.paused_rung` is the evaluation it is paused at
(None: not paused); its job is queued and held (`jobs.hold_until`) until the sweep's
controller releases or prunes it.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sweep_trials", sa.Column("paused_rung", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("sweep_trials", "paused_rung")
