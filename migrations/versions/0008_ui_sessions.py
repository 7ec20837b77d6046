"""The dashboard's logins: one-time login links (`torchyard ui`) and sessions, each
stored as the sha256 of its secret and tied to the API token that made it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _table(name: str, *extra: sa.Column[Any]) -> None:
    op.create_table(
        name,
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        *extra,
        sa.ForeignKeyConstraint(["token_id"], ["api_tokens.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("secret_hash"),
    )
    op.create_index(f"ix_{name}_token_id", name, ["token_id"])
    op.create_index(f"ix_{name}_expires_at", name, ["expires_at"])


def upgrade() -> None:
    _table("ui_login_links", sa.Column("used_at", sa.DateTime(timezone=True), nullable=True))
    _table("ui_sessions")


def downgrade() -> None:
    for name in ("ui_sessions", "ui_login_links"):
        op.drop_index(f"ix_{name}_expires_at", table_name=name)
        op.drop_index(f"ix_{name}_token_id", table_name=name)
        op.drop_table(name)
