#!/usr/bin/env bash
# Makes a Debian/Ubuntu host able to build and run policyloop's images with rootful podman when
# no Docker engine is installed: the packages, then the few containers.conf settings podman needs
# on hosts like the one this was written on (a cgroup v1 hierarchy without systemd; crun fails on
# it, runc works; the default ulimits cannot be raised inside such a host). Idempotent.
#
#   sudo docker/setup-podman.sh            # then: make images && make compose-up
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "run as root (rootful podman): sudo $0" >&2
  exit 1
fi

packages=(podman runc debootstrap podman-compose netavark aardvark-dns uidmap)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]}"
  apt-get install -y -q "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
fi

conf=/etc/containers/containers.conf
mkdir -p /etc/containers
if ! grep -q "policyloop: setup-podman.sh" "$conf" 2>/dev/null; then
  [ -f "$conf" ] && cp "$conf" "$conf.before-policyloop"
  cat > "$conf" <<'CONF'
# policyloop: setup-podman.sh (the previous file, if any, is containers.conf.before-policyloop)
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"

[network]
network_backend = "netavark"
CONF
  echo "wrote $conf"
fi

# Short names (nats:2.9-alpine) resolve on Docker Hub, as with docker.
reg=/etc/containers/registries.conf.d/50-policyloop-shortnames.conf
if [ ! -f "$reg" ]; then
  mkdir -p "$(dirname "$reg")"
  printf 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n' > "$reg"
fi

podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Host.NetworkBackend}}'
