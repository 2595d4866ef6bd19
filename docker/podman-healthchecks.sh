#!/usr/bin/env bash
# Runs the health checks of a compose project's podman containers on hosts without systemd.
# Podman schedules HEALTHCHECKs with systemd timers; without systemd nothing runs them, every
# container stays "starting", and compose's `depends_on: condition: service_healthy` waits
# forever. This loop does what the timers would: `podman healthcheck run` for each running
# container of the project every few seconds, and exits once the project has no containers left.
#
#   docker/podman-healthchecks.sh <project> [interval_s]    (docker/compose.sh starts it)
set -uo pipefail
project=${1:?project name}
interval=${2:-5}
idle=0
while [ "$idle" -lt 12 ]; do
  mapfile -t containers < <(podman ps --filter "label=com.docker.compose.project=$project" --format '{{.ID}}')
  if [ "${#containers[@]}" -eq 0 ]; then
    idle=$((idle + 1))
  else
    idle=0
    for id in "${containers[@]}"; do
      # Containers without a healthcheck answer an error: nothing to do for them.
      podman healthcheck run "$id" >/dev/null 2>&1 || true
    done
  fi
  sleep "$interval"
done
