"""Helpers the test suites share, imported as a package (`support.…`: tests/ is on the
path, pyproject.toml's pythonpath; no test edits sys.path, tests/test_code_shape.py).

Plugins (tests/conftest.py's pytest_plugins): `timing` (--timing-report), `backends` (the
database backends a test runs on), `db` (the database fixtures on them, and Factory),
`lanes` (-m fast). Helpers: `worker_cluster` (real processes: api, scheduler, workers),
`worker_factories` (rows for the worker and scheduler tests), `services` (private
PostgreSQL and Redis), `liveserver` (the app under uvicorn in a thread), `webhook_receiver`,
`follow` (SSE followers and what they cost, shared with bench/follow_bench.py)."""
