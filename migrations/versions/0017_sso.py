"""Single sign-on with OpenID Connect (api/oidc.py, store/sso.py):

- `sso_logins`: dashboard sign-ins under way at the provider, keyed by the sha256 of their
  `state`, bound to the browser's cookie (its sha256), with their nonce and PKCE verifier;
  each good once, for minutes.
- `user_identities`: the provider account (issuer, `sub`) bound to each user at their
  first sign-in, one per issuer and user, and what the provider's groups gave them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sso_logins",
        sa.Column("state_hash", sa.String(64), primary_key=True),
        sa.Column("browser_hash", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(64), nullable=False),
        sa.Column("code_verifier", sa.String(128), nullable=False),
        sa.Column("next_path", sa.String(200), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
    )
    op.create_index("ix_sso_logins_expires_at", "sso_logins", ["expires_at"])
    op.create_table(
        "user_identities",
        sa.Column("issuer", sa.String(300), primary_key=True),
        sa.Column("subject", sa.String(255), primary_key=True),
        sa.Column(
            "user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("granted", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("last_login_at", _TS, nullable=False),
        sa.UniqueConstraint("issuer", "user_id", name="uq_user_identities_user"),
    )


def downgrade() -> None:
    op.drop_table("user_identities")
    op.drop_index("ix_sso_logins_expires_at", table_name="sso_logins")
    op.drop_table("sso_logins")
