#!/usr/bin/env bash
# Builds the dashboard (web/) into api/static/, which the API serves at / and a wheel
# includes: installs web/'s npm packages exactly as package-lock.json pins them (again only
# when the lock file changed), then bundles with esbuild (web/build.mjs). Needs Node 18+.
# No Python: the state lists (web/src/states.gen.js) are generated from contracts/states.py
# and committed; tests/web/test_states_gen.py fails, naming the command, when they are stale.
set -euo pipefail
cd "$(dirname "$0")/../web"
if ! command -v npm >/dev/null 2>&1; then
  echo "build_web.sh: npm not found: install Node.js 18 or newer (Debian: apt-get install nodejs npm)" >&2
  exit 1
fi
STAMP=node_modules/.torchyard-lock-sha256
WANT=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  npm ci --no-audit --no-fund --loglevel=error
  echo "$WANT" >"$STAMP"
fi
node build.mjs
