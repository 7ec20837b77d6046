#!/usr/bin/env bash
# Restore a backup made by scripts/backup.sh into a fresh Docker Compose deployment (empty
# volumes: a new host, or after `docker compose down -v`), then start it:
#   1. postgres alone, and pg_restore of torchyard.dump into its (empty) torchyard database
#      (--clean --if-exists --no-owner, as the torchyard user, in one transaction)
#   2. objects.tar into the objectstore's volume, with the objectstore not running
#   3. the normal start, `up -d`: migrate brings a backup from an older release to this
#      image's schema, then the api, scheduler and workers start
# The secrets may differ from the old deployment's: database roles and the object store's
# keys are not in the backup, and API tokens (in the database) keep working. Redis is not
# restored: it holds no state the database does not (PostgreSQL is the truth).
#
# Usage: scripts/restore.sh [--no-start] DIR    (--no-start: stop before step 3)
# COMPOSE: the compose command with its options, as for scripts/backup.sh. A database that
# already has tables is refused (TORCHYARD_RESTORE_OVER=1 restores over it).
set -euo pipefail
start=1
if [ "${1:-}" = --no-start ]; then
  start=0
  shift
fi
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 [--no-start] DIR   (COMPOSE=\"docker compose\" by default)" >&2
  exit 2
fi
read -r -a compose <<<"${COMPOSE:-docker compose}"
dir="$(cd "$1" && pwd)"
say() { echo "restore: $*" >&2; }
pg() { "${compose[@]}" exec -T postgres "$@"; }
(cd "$dir" && sha256sum --quiet -c SHA256SUMS) || { say "$dir: files missing or damaged"; exit 2; }
sed 's/^/restore: backup /' "$dir/MANIFEST" >&2

say "starting postgres"
"${compose[@]}" up -d postgres
# Over TCP: the official image's first start runs a socket-only server while it initialises.
for _ in $(seq 120); do
  pg pg_isready -q -h 127.0.0.1 -U torchyard -d torchyard && break
  sleep 1
done
pg pg_isready -h 127.0.0.1 -U torchyard -d torchyard >/dev/null
tables="$(pg psql -U torchyard -d torchyard -Atc \
  "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")"
if [ "$tables" != 0 ] && [ "${TORCHYARD_RESTORE_OVER:-0}" != 1 ]; then
  say "the database already has $tables tables: not a fresh deployment (TORCHYARD_RESTORE_OVER=1 restores over it)"
  exit 2
fi
say "database <- torchyard.dump"
pg pg_restore -U torchyard -d torchyard --clean --if-exists --no-owner --single-transaction \
  <"$dir/torchyard.dump"

say "object store <- objects.tar"
"${compose[@]}" stop -t 30 objectstore >/dev/null 2>&1 || true  # none yet on a fresh deployment
"${compose[@]}" run --rm --no-deps -T -u 0 -v "$dir:/backup:ro" objectstore \
  'find /data -mindepth 1 -delete && tar -C /data -xf /backup/objects.tar'

if [ "$start" = 1 ]; then
  say "starting the deployment"
  "${compose[@]}" up -d
fi
say "done"
