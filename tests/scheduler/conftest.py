"""Fixtures for the scheduler tests: the database fixtures and factories they share with
the worker tests, which live beside those (tests/worker/worker_db.py, worker_factories.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker"))

import worker_db as _db

# The shared database fixtures (re-exported so pytest finds them here).
db_url = _db.db_url
pg_fresh_url = _db.pg_fresh_url
session = _db.session
sqlite_url = _db.sqlite_url
