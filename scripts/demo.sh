#!/usr/bin/env bash
# The README's main job, on a fresh machine: make the venv from the repo's files, start
# torchyard (`torchyard up`: API, scheduler, 2 CPU workers, or one per GPU), train the
# digits example while following its progress, draw its loss curve, download the trained
# checkpoint with its sha256 verified, then stop everything.
#   PYTHON=python3.11  TORCHYARD_PORT=8000  TORCHYARD_HOME=./.torchyard  (defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
PORT="${TORCHYARD_PORT:-8000}"
export TORCHYARD_HOME="${TORCHYARD_HOME:-$PWD/.torchyard}"
export TORCHYARD_URL="http://127.0.0.1:$PORT"
unset TORCHYARD_TOKEN  # use the admin token of the `up` started here
SECONDS=0

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
fi
# The install is editable, so only a change of the dependencies needs pip again.
STAMP=.venv/.torchyard-demo-installed
WANT=$(cat pyproject.toml constraints.txt | .venv/bin/python -c "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "==> installing torchyard into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e .
  echo "$WANT" >"$STAMP"
fi
TY=.venv/bin/torchyard
# The dashboard (served at / by the API); skipped, with a note, where there is no Node.
if command -v npm >/dev/null 2>&1; then
  echo "==> building the dashboard"
  bash scripts/build_web.sh
else
  echo "==> no npm: the dashboard is not built (the API answers / with how to build it)"
fi

# From here on every file and folder is this user's alone (umask 077): the home holds the
# admin token, and up.log shows it. `up` makes a home others can read (an older run's)
# private too; an older up.log is replaced, never reused with its mode.
umask 077
mkdir -p "$TORCHYARD_HOME"
LOG="$TORCHYARD_HOME/up.log"
echo "==> starting torchyard up on port $PORT (output in $LOG)"
SECONDS=0  # the times below leave the install and the dashboard build out
rm -f "$LOG"  # before the start, so the wait below never reads a previous run's log
: >"$LOG"
"$TY" up --port "$PORT" >"$LOG" 2>&1 &
UP=$!
stop_up() {
  if kill -0 "$UP" 2>/dev/null; then
    echo "==> stopping torchyard up"
    kill -TERM "$UP" 2>/dev/null || true
    wait "$UP" 2>/dev/null || true
  fi
}
trap stop_up EXIT
until grep -q "torchyard is up" "$LOG" 2>/dev/null; do
  if ! kill -0 "$UP" 2>/dev/null; then
    echo "torchyard up exited early:" >&2
    cat "$LOG" >&2
    exit 1
  fi
  sleep 0.2
done
echo "==> up in ${SECONDS}s: $TORCHYARD_URL (admin token in $TORCHYARD_HOME/admin-token)"

echo "==> training examples/digits.json"
JOB=$("$TY" submit examples/digits.json --follow)

echo "==> loss curve"
"$TY" metrics "$JOB" --plot

echo "==> downloading the trained weights"
mkdir -p "$TORCHYARD_HOME/downloads"
"$TY" download "$JOB" -o "$TORCHYARD_HOME/downloads"

echo "==> done in ${SECONDS}s after the start (job $JOB)"
echo "==> torchyard is installed in .venv: put it on your PATH for the README's commands with"
echo "      source .venv/bin/activate     (or call $PWD/.venv/bin/torchyard)"
echo "    and start the service again with: torchyard up"
