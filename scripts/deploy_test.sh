#!/usr/bin/env bash
# The deployment test (tests/deploy/test_podman_compose.py, marker `deploy`): docker-compose.yml
# started for real with podman and podman-compose, from images built here.
#
# Podman runs with its own configuration and storage under TORCHYARD_DEPLOY_DIR (default
# /var/tmp/torchyard-deploy): nothing global changes, and `rm -rf` of that folder undoes it.
# The base image is Debian bookworm made by debootstrap and imported once (cached there);
# the test builds every other image from it, runs the stack and removes what it built.
# Needs root, Debian's podman, runc and debootstrap, and the dev extra (podman-compose).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${TORCHYARD_DEPLOY_DIR:-/var/tmp/torchyard-deploy}"
BASE_IMAGE=localhost/torchyard-base:bookworm
# The Debian archive to debootstrap from: TORCHYARD_DEBIAN_MIRROR, else the first URI of
# this host's own apt sources (deb822 or one-line format).
host_mirror() {
  { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
    grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'
  } | grep -m1 '/debian/\?$' || true
}
MIRROR="${TORCHYARD_DEBIAN_MIRROR:-$(host_mirror)}"
[ -n "$MIRROR" ] || { echo "deploy test: no Debian archive in this host's apt sources; set TORCHYARD_DEBIAN_MIRROR" >&2; exit 2; }
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || { echo "deploy test: $tool is missing (apt-get install podman runc debootstrap)" >&2; exit 2; }
done
mkdir -p "$DIR/storage" "$DIR/run" "$DIR/tmp"

# This host's kernel and limits: runc (crun fails on its cgroup layout), cgroupfs (no
# systemd), vfs storage, host networking (no bridge), ulimits within the hard limits.
cat >"$DIR/containers.conf" <<CONF
[containers]
netns = "host"
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "$DIR/tmp"
CONF
cat >"$DIR/storage.conf" <<CONF
[storage]
driver = "vfs"
graphroot = "$DIR/storage"
runroot = "$DIR/run"
CONF
export CONTAINERS_CONF="$DIR/containers.conf" CONTAINERS_STORAGE_CONF="$DIR/storage.conf"

# The base image, once: Debian's minimal system, trusting what this host trusts (its extra
# CAs, e.g. an intercepting proxy's), with policy-rc.d refusing service starts as in
# Debian's official images. PIP_CERT / NODE_EXTRA_CA_CERTS: pip and Node use their own CA
# lists otherwise.
if ! podman image exists "$BASE_IMAGE"; then
  rootfs="$DIR/rootfs"
  if [ ! -e "$rootfs/.torchyard-base" ]; then
    rm -rf "$rootfs"
    echo "==> debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$MIRROR" >"$DIR/debootstrap.log"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$rootfs" update-ca-certificates >/dev/null
    printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
    chmod 755 "$rootfs/usr/sbin/policy-rc.d"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
    touch "$rootfs/.torchyard-base"
  fi
  echo "==> podman import $BASE_IMAGE"
  tar -C "$rootfs" --exclude=./.torchyard-base -c . | podman import \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
fi

PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if [ ! -x "$(dirname "$PY")/podman-compose" ]; then
  echo "deploy test: podman-compose is missing next to $PY (pip install -c constraints.txt -e '.[dev]')" >&2
  exit 2
fi
export TORCHYARD_DEPLOY_TEST=1 TORCHYARD_DEPLOY_DIR="$DIR" TORCHYARD_DEPLOY_BASE="$BASE_IMAGE"
rm -f "$DIR/timings.json"
rc=0
"$PY" -m pytest -m deploy -p no:cacheprovider tests/deploy/test_podman_compose.py "$@" || rc=$?
[ -f "$DIR/timings.json" ] && echo "deploy timings (s): $(cat "$DIR/timings.json")"
exit "$rc"
