"""Webhooks and their durable outbox (store/webhooks.py, scheduler/notify.py):

- `webhooks`: a user's or a project's subscription to job and sweep endings (url, events,
  the signing secret, active).
- `webhook_deliveries`: the outbox, one row per event and webhook, written in the
  transaction of the state change; its sender's lease (`lease_until`, `claimed_by`), its
  retries (`attempts`, `next_attempt_at`) and its outcome.
- `webhook_attempts`: every try at sending a delivery.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_PENDING = sa.text("state = 'pending'")


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column(
            "owner_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column(
            "project_id",
            sa.Integer(),
            sa.ForeignKey("projects.id", ondelete="CASCADE"),
            nullable=True,
        ),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("secret", sa.String(256), nullable=False),
        sa.Column("active", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_index("ix_webhooks_owner", "webhooks", ["owner_id"])
    op.create_index("ix_webhooks_project", "webhooks", ["project_id"])
    _deliveries()
    _attempts()


def _deliveries() -> None:
    op.create_table(
        "webhook_deliveries",
        sa.Column("seq", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column(
            "webhook_id",
            sa.String(32),
            sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(32), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", _TS, nullable=False),
        sa.Column("lease_until", _TS, nullable=True),
        sa.Column("claimed_by", sa.String(100), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", _TS, nullable=True),
    )
    op.create_index("ix_webhook_deliveries_webhook", "webhook_deliveries", ["webhook_id", "seq"])
    op.create_index(
        "ix_webhook_deliveries_pending",
        "webhook_deliveries",
        ["webhook_id", "subject", "seq"],
        postgresql_where=_PENDING,
        sqlite_where=_PENDING,
    )


def _attempts() -> None:
    op.create_table(
        "webhook_attempts",
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column(
            "delivery_id",
            sa.String(32),
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_webhook_attempts_delivery", "webhook_attempts", ["delivery_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_attempts_delivery", table_name="webhook_attempts")
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_pending", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_webhook", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhooks_owner", table_name="webhooks")
    op.drop_index("ix_webhooks_project", table_name="webhooks")
    op.drop_table("webhooks")
