#!/usr/bin/env bash
# Type-check the product code with mypy under its installed names (torchyard.api, …).
# pyproject.toml maps each top-level folder onto the `torchyard` namespace, which mypy
# cannot follow, so this builds the same tree out of symbolic links in .typecheck/ and
# checks it there with the repository's [tool.mypy] settings. Exits non-zero on an error.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tree=.typecheck/torchyard
rm -rf .typecheck
mkdir -p "$tree"
for f in torchyard/*.py; do ln -s "$repo/$f" "$tree/"; done
for part in $(.venv/bin/python - <<'PY'
import tomllib
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
print(" ".join(d for name, d in dirs.items() if name != "torchyard"))
PY
); do
  ln -s "$repo/$part" "$tree/$part"
done
cd .typecheck
exec "$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p torchyard
