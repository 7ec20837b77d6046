"""Teams: projects and their members, the audit trail, and jobs one can organise.

- `projects` and `project_members`: every user gets a personal project `~<name>` they own;
  every existing job and sweep is moved into its owner's personal project
  (`jobs.project_id`, `sweeps.project_id`).
- `audit_log`: append-only, enforced by triggers that refuse UPDATE and DELETE (and, on
  PostgreSQL, TRUNCATE), so that no path of torchyard can edit or remove an entry.
- `jobs.tags` (and `job_tags`, which the tag filter reads), `jobs.notes`,
  `jobs.archived_at`, `jobs.rerun_of`.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)
_PG_TRIGGER = """
CREATE FUNCTION torchyard_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'audit_log is append-only'; END $$;
CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION torchyard_audit_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION torchyard_audit_append_only();
"""
_SQLITE_TRIGGERS = [
    "CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log "
    "BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END",
    "CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log "
    "BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END",
]


def _tables() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(101), nullable=False, unique=True),
        sa.Column(
            "personal_of",
            sa.Integer(),
            sa.ForeignKey("users.id", ondelete="CASCADE"),
            nullable=True,
            unique=True,
        ),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("share", sa.Float(), server_default="1", nullable=False),
    )
    op.create_table(
        "project_members",
        sa.Column(
            "project_id",
            sa.Integer(),
            sa.ForeignKey("projects.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("role", sa.String(8), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_index("ix_project_members_user", "project_members", ["user_id", "project_id"])
    big_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "audit_log",
        sa.Column("id", big_id, primary_key=True, autoincrement=True),
        sa.Column("time", _TS, nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=True),
        sa.Column("user_name", sa.String(100), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("target", sa.String(300), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("client", sa.String(100), nullable=True),
    )
    op.create_index("ix_audit_log_project", "audit_log", ["project_id", "id"])
    op.create_index("ix_audit_log_user", "audit_log", ["user_name", "id"])
    op.create_index("ix_audit_log_action", "audit_log", ["action", "id"])
    op.create_table(
        "job_tags",
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("tag", sa.String(64), primary_key=True),
    )
    op.create_index("ix_job_tags_tag", "job_tags", ["tag", "job_id"])


def _columns() -> None:
    # Not in batch mode: SQLite adds (and, 3.35+, drops) columns in place, where a rebuild
    # of `jobs` trips over the foreign keys that point at it.
    op.add_column("jobs", sa.Column("project_id", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("tags", sa.JSON(), server_default="[]", nullable=False))
    op.add_column("jobs", sa.Column("notes", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("archived_at", _TS, nullable=True))
    op.add_column("jobs", sa.Column("rerun_of", sa.String(32), nullable=True))
    op.create_index("ix_jobs_project_created", "jobs", ["project_id", "created_at"])
    op.add_column("sweeps", sa.Column("project_id", sa.Integer(), nullable=True))


def _personal_projects() -> None:
    """Every user's personal project, owned by them; their jobs and sweeps move into it."""
    op.execute(
        "INSERT INTO projects (name, personal_of, created_at) "
        "SELECT '~' || name, id, created_at FROM users"
    )
    op.execute(
        "INSERT INTO project_members (project_id, user_id, role, created_at) "
        "SELECT id, personal_of, 'owner', created_at FROM projects"
    )
    for table in ("jobs", "sweeps"):
        op.execute(
            f"UPDATE {table} SET project_id = "  # fixed table names, no input
            f"(SELECT p.id FROM projects p WHERE p.personal_of = {table}.owner_id)"
        )


def upgrade() -> None:
    _tables()
    _columns()
    _personal_projects()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_TRIGGER)
    else:
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TABLE audit_log")
        op.execute("DROP FUNCTION torchyard_audit_append_only()")
    else:
        op.drop_table("audit_log")
    op.drop_column("sweeps", "project_id")
    op.drop_index("ix_jobs_project_created", table_name="jobs")
    for column in ("rerun_of", "archived_at", "notes", "tags", "project_id"):
        op.drop_column("jobs", column)
    op.drop_table("job_tags")
    op.drop_table("project_members")
    op.drop_table("projects")
