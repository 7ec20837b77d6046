"""Bundle usage: `bundles.last_used_at`, when the bundle was last uploaded again or named by
a submitted job. The scheduler removes bundles unused for TORCHYARD_BUNDLE_RETENTION_S
(store/bundles.py: `remove_unused_bundles`); rows from before count from their upload
(`created_at`, read where this is null).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in batch mode: SQLite adds (and, 3.35+, drops) the column in place, where a
    # rebuild of the table trips over the foreign keys that point at it.
    op.add_column("bundles", sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("bundles", "last_used_at")
