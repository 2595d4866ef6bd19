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

# Named one by one, recommends not relied on (many hosts turn them off): podman and the OCI runtime;
# its network stack, all of which rootful podman drives for every container and every build RUN
# (netavark makes the bridge, aardvark-dns answers the compose service names, and netavark runs
# iptables/ip6tables for NAT and port forwards: without them every container fails with
# "netavark: No such file or directory"); conmon and catatonit (podman's monitor and --init);
# debootstrap and tar for the offline Debian base; docker-compose (the compose that
# docker/compose.sh runs against podman's socket), curl (which pings that socket) and
# podman-compose (the fallback).
packages=(podman runc conmon catatonit netavark aardvark-dns iptables uidmap debootstrap tar
          docker-compose podman-compose curl)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]}"
  # Waits for another apt (another setup on a shared host) rather than failing on its lock.
  apt=(apt-get -o DPkg::Lock::Timeout=600 install -y -q)
  "${apt[@]}" "${missing[@]}" >/dev/null \
    || { apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && "${apt[@]}" "${missing[@]}" >/dev/null; }
fi

# iptables is the nf_tables flavour by default; a kernel without nf_tables has only the legacy one.
if ! iptables -t nat -L -n >/dev/null 2>&1 && iptables-legacy -t nat -L -n >/dev/null 2>&1; then
  update-alternatives --set iptables /usr/sbin/iptables-legacy
  update-alternatives --set ip6tables /usr/sbin/ip6tables-legacy
  echo "iptables: the legacy backend (this kernel has no nf_tables)"
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

# The network stack end to end, before any build needs it: a container (the host's own root as an
# overlay, so no image is needed) on a network of its own, which runs netavark, its iptables rules
# and aardvark-dns. A missing piece fails here, by name, not at an image build's first RUN.
check_net=policyloop-setup-check
podman network rm -f "$check_net" >/dev/null 2>&1 || true
podman network create "$check_net" >/dev/null
if ! out=$(podman run --rm --network "$check_net" --rootfs /:O true 2>&1); then
  podman network rm -f "$check_net" >/dev/null 2>&1 || true
  echo "podman cannot start a container with networking: $out" >&2
  for bin in iptables ip6tables; do command -v "$bin" >/dev/null || echo "  $bin is missing" >&2; done
  for bin in netavark aardvark-dns; do
    [ -x "/usr/lib/podman/$bin" ] || [ -x "/usr/libexec/podman/$bin" ] || echo "  $bin is missing" >&2
  done
  exit 1
fi
podman network rm -f "$check_net" >/dev/null 2>&1 || true
echo "podman: a container with networking started (netavark, iptables, aardvark-dns)"
