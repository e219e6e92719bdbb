#!/usr/bin/env bash
# A copy of the development machines' ../shared/tools/container-base.sh, kept here so that CI on a
# machine without that folder can still build and run the images (.ci/run prefers the machine's own).
# Builds and runs the project's container images on a machine without Docker and without access to
# an image registry (such as the development and CI machines): podman/buildah in chroot isolation,
# and a locally built stand-in for the `python:3.11-slim` base image (Debian bookworm, Python 3.11,
# pip pointed at the same package index and CA bundle as the host).
#
#   ../shared/tools/container-base.sh            # once per machine: installs podman, buildah,
#                                                # debootstrap; builds and tags the base image
#   podman build --isolation=chroot --pull=never --network=host -f docker/Dockerfile.server -t stoker-server .
#   c=$(buildah from --pull-never localhost/stoker-server)
#   buildah run --isolation chroot --user 10001:10001 -v "$PWD/cfg.yaml:/etc/stoker/config.yaml:ro" \
#       -v /data:/data:ro "$c" -- stoker serve --config /etc/stoker/config.yaml --host 127.0.0.1
#   buildah rm "$c"
#
# The container shares the host's network (chroot isolation): its ports are host ports. `podman run`
# itself does not work here (the VM refuses the runtime's cgroup and rlimit setup); `buildah run
# --isolation chroot` does. Only the FROM image is a stand-in: every step after FROM runs for real.
set -euo pipefail
TAG=${TAG:-docker.io/library/python:3.11-slim}
if podman image exists "$TAG" 2>/dev/null; then echo "$TAG already present"; exit 0; fi
need=()
for tool in podman buildah debootstrap; do command -v $tool >/dev/null || need+=($tool); done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman buildah debootstrap fuse-overlayfs uidmap >/dev/null
fi
root=$(mktemp -d /tmp/python-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >/dev/null
# What the official image offers: `python` and `pip` on PATH, pip free to install system-wide.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
printf '#!/bin/sh\nexec python3 -m pip "$@"\n' > "$root/usr/local/bin/pip"
chmod +x "$root/usr/local/bin/pip"
# The host's CA bundle and pip settings (index, constraints), so that pip inside reaches the index.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
mkdir -p "$root/etc/xdg/pip"
{ echo "[global]"; echo "cert = /etc/ssl/certs/ca-certificates.crt"
  [ -f /etc/xdg/pip/constraints.txt ] && cp /etc/xdg/pip/constraints.txt "$root/etc/xdg/pip/" \
      && echo "constraint = /etc/xdg/pip/constraints.txt"; } > "$root/etc/xdg/pip/pip.conf"
tar -C "$root" -c . | podman import - "$TAG" >/dev/null
echo "built $TAG (a local stand-in: Debian bookworm, $("$root/usr/bin/python3" --version 2>&1 || echo python3))"
