"""Alembic migrations: `torchyard db upgrade` (store.migrate.upgrade) runs them to head."""
