"""API tokens get a label (`POST /v1/tokens`, `torchyard token create --label`): a name
their owner and the admins tell them apart by in `GET /v1/tokens` (the secret is never shown
again after it is made).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("label", sa.String(length=100), nullable=True))


def downgrade() -> None:
    op.drop_column("api_tokens", "label")  # in place (SQLite 3.35+), no table rebuild
