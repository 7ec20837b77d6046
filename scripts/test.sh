#!/usr/bin/env bash
# The README's test command: make the venv from the repo's files, lint, check formatting
# and types, run every test.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m e2e`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
# System packages: only those the selected tests need (scripts/test_needs.py; every one
# without arguments, as CI runs it; README, Tests, lists them and who needs each).
picked=" $(.venv/bin/python scripts/test_needs.py "$@" | tr '\n' ' ') " || picked=" all "
want() { [[ "$picked" == *" all "* || "$picked" == *" $1 "* ]]; }
# The dashboard's browser tests need Debian's chromium and Node (for the build), the sandbox
# bubblewrap; as root they are installed when missing, else the tests say what is missing (and fail under CI).
need=()
want chromium && { command -v chromium >/dev/null 2>&1 || need+=(chromium); }
want npm && { command -v npm >/dev/null 2>&1 || need+=(nodejs npm); }
# The trainer's sandbox (worker/sandbox.py): under CI its tests fail, never skip, without it.
want bubblewrap && { command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap); }
# promtool (tests/test_alert_rules.py) comes in Debian's `prometheus` package, whose install
# would start a Prometheus server (and its node exporter) where the host runs systemd: a
# policy-rc.d answering 101 keeps every service of this install stopped, as in Docker
# images, and goes again after it (one already there is left as it is).
want prometheus && { command -v promtool >/dev/null 2>&1 || need+=(prometheus); }
# The Slurm test (tests/deploy/test_slurm.py) starts its own munged, slurmctld and slurmd;
# the same policy-rc.d keeps the packages' own services stopped.
want slurm-wlm && { command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm munge); }
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> installing ${need[*]}"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      policy=/usr/sbin/policy-rc.d
      printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
      trap 'rm -f "$policy"' EXIT
    fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    if [ -n "$policy" ]; then rm -f "$policy"; trap - EXIT; fi
    if [[ " ${need[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
      # Only promtool is wanted: no server at the next boot either.
      systemctl disable prometheus prometheus-node-exporter >/dev/null 2>&1 || true
    fi
    if [[ " ${need[*]} " == *" slurm-wlm "* ]] && command -v systemctl >/dev/null 2>&1; then
      # The test starts private daemons; none of the machine's own at the next boot.
      systemctl disable slurmctld slurmd munge >/dev/null 2>&1 || true
    fi
  else
    echo "note: ${need[*]} missing: the tests that need them will not run" >&2
  fi
fi
if command -v npm >/dev/null 2>&1; then
  bash scripts/build_web.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
# TORCHYARD_TEST_PROCESSES=N (N > 1) runs the tests in N processes (pytest-xdist), each
# module whole in one (its module-scoped cluster starts once), the longest modules first
# (tests/support/order.py). One process by default: on a 2-core machine the end-to-end
# modules already keep both cores busy, and three processes ran no faster (README, Tests).
# An -n given here replaces this.
xdist=()
if [ "${TORCHYARD_TEST_PROCESSES:-1}" -gt 1 ]; then
  xdist=(-n "$TORCHYARD_TEST_PROCESSES" --dist loadfile --no-loadscope-reorder)
fi
for arg in "$@"; do
  case "$arg" in -n | -n[0-9]* | --numprocesses* | no:xdist) xdist=() ;; esac
done
.venv/bin/python -m pytest "${xdist[@]}" "$@"
