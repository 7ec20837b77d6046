#!/usr/bin/env bash
# The README's test command: make the venv from the repo's files, lint, run every test.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m e2e`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
