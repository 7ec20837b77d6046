"""Helpers the test suites share, imported as a package (`support.…`: tests/ is on the
path, pyproject.toml's pythonpath)."""
