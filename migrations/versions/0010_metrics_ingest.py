"""Cheaper metric ingest (bench/ingest_bench.py): `metrics` and `metric_blocks` lose their
foreign key to `jobs`, and on PostgreSQL their text keys (job_id, name) compare bytewise
(COLLATE "C", the order SQLite uses already).

Each point inserted checked its job's row (an index probe into `jobs` and a KEY SHARE lock
on the row, per point). Jobs are never deleted, and every write of points is fenced by
an active attempt of the job (store/attempts.py fence_flush), so the job exists. The
check cost ~8-9 µs of server CPU per point (18.5-21 -> 10-11 µs/point through the
worker's flush, batches of 1,000, PostgreSQL 15; issue 9); COLLATE "C" ~0.5 µs more
(medians 10.6 -> 10.1 µs/point: the (job_id, name, step) index compares by memcmp, not
the locale's strcoll). bench/ingest_bench.py shows both: "new, 0009 schema" vs "new". Bytewise order changes how series names sort only where the
database's collation is not code-point order (en_US: case-insensitive first), as SQLite.

SQLite has no COLLATE change (it compares bytes already); its tables are rebuilt without
the foreign key (batch mode), since SQLite cannot drop a constraint in place.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("metrics", "metric_blocks")
# 0001 left the SQLite foreign keys unnamed: batch mode finds them by this convention.
SQLITE_FK = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def _collate(table: str, collation: str) -> str:
    return (
        f'ALTER TABLE {table} ALTER COLUMN job_id TYPE varchar(32) COLLATE "{collation}", '
        f'ALTER COLUMN name TYPE varchar(100) COLLATE "{collation}"'
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_job_id_fkey")
            op.execute(_collate(table, "C"))  # rebuilds the table's indexes
        return
    for table in TABLES:
        with op.batch_alter_table(table, naming_convention=SQLITE_FK) as batch_op:
            batch_op.drop_constraint(f"fk_{table}_job_id_jobs", type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(_collate(table, "default"))
            op.create_foreign_key(
                f"{table}_job_id_fkey", table, "jobs", ["job_id"], ["id"], ondelete="CASCADE"
            )
        return
    for table in TABLES:
        with op.batch_alter_table(table) as batch_op:
            batch_op.create_foreign_key(
                f"fk_{table}_job_id_jobs", "jobs", ["job_id"], ["id"], ondelete="CASCADE"
            )
