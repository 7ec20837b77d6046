"""Storage tests: the shared database fixtures (for the store's reads through the seam)."""

from __future__ import annotations

import sys
from pathlib import Path

# The database fixtures live beside the store tests; these suites share them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))

import torchyard_testdb as _db

db_url = _db.db_url
factory = _db.factory
pg_migrated = _db.pg_migrated
session = _db.session
settings = _db.settings
sqlite_template = _db.sqlite_template
