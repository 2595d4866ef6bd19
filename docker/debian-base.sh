#!/usr/bin/env bash
# Builds a Debian base image locally with debootstrap and `podman import`, for hosts that cannot
# pull images from a registry. The image is a plain `debian:<suite>` minbase with apt sources, so
# the Dockerfiles' apt-get and pip steps work in it as in the official images.
#
#   sudo docker/debian-base.sh                     # -> localhost/debian:bookworm
#   sudo docker/debian-base.sh bookworm http://deb.debian.org/debian
set -euo pipefail

suite=${1:-bookworm}
mirror=${2:-http://deb.debian.org/debian}
tag=${DEBIAN_BASE_TAG:-localhost/debian:$suite}
engine=${CONTAINER_ENGINE:-podman}

if "$engine" image exists "$tag" 2>/dev/null; then
  echo "$tag exists"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "run as root (debootstrap): sudo $0" >&2
  exit 1
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d /var/tmp/policyloop-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
  || { echo "debootstrap failed ($root.log):" >&2; tail -30 "$root.log" >&2; exit 1; }
rm -f "$root.log"
# What the official image trims: package lists and caches (apt-get update fetches them again).
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
echo "deb $mirror $suite main" > "$root/etc/apt/sources.list"
if [ "$suite" != sid ]; then
  echo "deb $mirror $suite-updates main" >> "$root/etc/apt/sources.list"
fi
tar -C "$root" -c . | "$engine" import \
  --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
  --message "debootstrap --variant=minbase $suite $mirror" - "$tag"
echo "built $tag"
