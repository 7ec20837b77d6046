"""Store tests: the shared database fixtures, on SQLite and PostgreSQL."""

import torchyard_testdb as _db

# The shared database fixtures (re-exported so pytest finds them here).
db_url = _db.db_url
empty_url = _db.empty_url
factory = _db.factory
pg_migrated = _db.pg_migrated
session = _db.session
settings = _db.settings
sqlite_template = _db.sqlite_template
