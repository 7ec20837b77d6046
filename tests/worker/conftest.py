"""Fixtures for the worker tests: the shared database fixtures (worker_db.py, which the
scheduler tests use too); factories with keyword defaults are in worker_factories.py."""

import worker_db as _db

# The shared database fixtures (re-exported so pytest finds them here).
db_url = _db.db_url
pg_fresh_url = _db.pg_fresh_url
session = _db.session
sqlite_url = _db.sqlite_url
