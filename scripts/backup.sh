#!/usr/bin/env bash
# Back up a Docker Compose deployment of torchyard (docker-compose.yml) into DIR:
#   torchyard.dump  the database, `pg_dump -Fc` in the postgres service (online: one
#                   consistent snapshot while everything keeps running)
#   objects.tar     the object store's data (the objectstore service's /data volume:
#                   checkpoints, logs, bundles, data sets), copied with the objectstore
#                   stopped for 10-20 s so SeaweedFS's files are consistent; torchyard
#                   rides that out (workers keep checkpoints and upload them once it is back)
#   MANIFEST        when, the schema revision (what `torchyard db current` prints), the image
#   SHA256SUMS      of the two files; scripts/restore.sh checks them
# The dump comes first, the objects second, so every object the dump names is in the copy,
# except a checkpoint that keep_last pruned in between (final weights and each job's newest
# checkpoints are never pruned). For an exact copy, stop api, scheduler and the workers
# first. Restore with scripts/restore.sh DIR (README: Backup and restore).
#
# Usage: scripts/backup.sh DIR       (DIR is made; an existing backup in it is refused)
# COMPOSE: the compose command with its options (default `docker compose`), split on spaces,
# e.g. COMPOSE="podman-compose -p torchyard -f docker-compose.yml -f deploy/compose.cpu.yml".
# Run it in the compose file's folder with the environment `up` had (the secrets).
set -euo pipefail
umask 077  # the dump holds every user's data and token hashes
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 DIR   (COMPOSE=\"docker compose\" by default)" >&2
  exit 2
fi
read -r -a compose <<<"${COMPOSE:-docker compose}"
mkdir -p "$1"
dir="$(cd "$1" && pwd)"
if [ -e "$dir/torchyard.dump" ] || [ -e "$dir/objects.tar" ]; then
  echo "backup: $dir already holds a backup; choose an empty folder" >&2
  exit 2
fi
pg() { "${compose[@]}" exec -T postgres "$@"; }
say() { echo "backup: $*" >&2; }

say "database -> $dir/torchyard.dump"
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"  # the dump's moment: what the backup is a copy of
pg pg_dump -U torchyard -d torchyard -Fc >"$dir/torchyard.dump.part"
mv "$dir/torchyard.dump.part" "$dir/torchyard.dump"
# alembic_version is what `torchyard db current` reads; psql needs no torchyard container.
revision="$(pg psql -U torchyard -d torchyard -Atc 'SELECT version_num FROM alembic_version')"

say "object store -> $dir/objects.tar (objectstore stopped meanwhile)"
# -t 30: its volume server waits 10 s after SIGTERM before it shuts down.
"${compose[@]}" stop -t 30 objectstore
# Started again whatever happens to the copy.
trap '"${compose[@]}" start objectstore >/dev/null' EXIT
"${compose[@]}" run --rm --no-deps -T -u 0 -v "$dir:/backup" objectstore \
  'tar -C /data -cf /backup/objects.tar.part . && mv /backup/objects.tar.part /backup/objects.tar'
trap - EXIT
"${compose[@]}" start objectstore

cat >"$dir/MANIFEST" <<EOF
created: $created
schema_revision: ${revision:-none}
image: ${TORCHYARD_IMAGE:-torchyard:latest}
database: torchyard.dump (pg_dump -Fc)
objects: objects.tar (the objectstore volume, /data)
EOF
(cd "$dir" && sha256sum torchyard.dump objects.tar >SHA256SUMS)
say "done: $dir (schema revision ${revision:-none})"
