"""Priority is a permission: `users.max_priority`, the highest priority an admin lets a user
give their jobs (set with the quota, PUT /v1/users/{name}/quota). Null is the default,
0 (store/quotas.py: DEFAULT_MAX_PRIORITY): a user orders their own jobs at or below 0 and
preempts nobody else's. The same number protects the user's running jobs: another user's
job preempts them only with a priority above it (scheduler/preemption.py).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in batch mode: SQLite adds (and, 3.35+, drops) the column in place, where a
    # rebuild of the table trips over the foreign keys that point at it.
    op.add_column("users", sa.Column("max_priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("users", "max_priority")
