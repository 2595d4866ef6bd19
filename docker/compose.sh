#!/usr/bin/env bash
# Runs compose for policyloop's compose.yaml with whatever this host has: `docker compose` or
# docker-compose against a Docker engine, else docker-compose against rootful podman's
# Docker-compatible socket (started here if it is not running), else podman-compose.
# The image names `make images` built (docker/images.env) are passed on. COMPOSE_GPU=1 adds
# compose.gpu.yaml, COMPOSE_TINKER=1 compose.tinker.yaml (the Tinker API), COMPOSE_REWARD_MODEL=1
# compose.reward-model.yaml (a reward model's engine, which reward and evaluator score with),
# COMPOSE_MULTINODE_LEARNER=1 compose.multinode-learner.yaml (the learner as two torchrun nodes).
#
#   docker/compose.sh up -d --no-build      # make compose-up
#   docker/compose.sh ps
#   docker/compose.sh down --volumes        # make compose-down
set -euo pipefail
cd "$(dirname "$0")/.."

project=${COMPOSE_PROJECT_NAME:-policyloop}
files=(-f compose.yaml)
[ -n "${COMPOSE_GPU:-}" ] && files+=(-f compose.gpu.yaml)
[ -n "${COMPOSE_TINKER:-}" ] && files+=(-f compose.tinker.yaml)
[ -n "${COMPOSE_REWARD_MODEL:-}" ] && files+=(-f compose.reward-model.yaml)
if [ -n "${COMPOSE_MULTINODE_LEARNER:-}" ]; then
  # Combinations that would start a learner group that cannot train (compose.multinode-learner.yaml).
  if [ -n "${COMPOSE_GPU:-}" ]; then
    echo "COMPOSE_MULTINODE_LEARNER runs the learner's two nodes on the CPU: not with COMPOSE_GPU, which gives a GPU to node 0 alone (one torchrun agent with --nproc_per_node uses a host's GPUs)" >&2
    exit 2
  fi
  if [ -n "${COMPOSE_TINKER:-}" ]; then
    echo "COMPOSE_MULTINODE_LEARNER: not with COMPOSE_TINKER, the Tinker API trains on one rank" >&2
    exit 2
  fi
  files+=(-f compose.multinode-learner.yaml)
fi
env_file=()
[ -f docker/images.env ] && env_file=(--env-file docker/images.env)

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  if docker compose version >/dev/null 2>&1; then
    exec docker compose -p "$project" "${env_file[@]}" "${files[@]}" "$@"
  fi
  exec docker-compose -p "$project" "${env_file[@]}" "${files[@]}" "$@"
fi

if command -v podman >/dev/null && command -v docker-compose >/dev/null; then
  socket=${PODMAN_SOCKET:-/run/podman/podman.sock}
  if ! curl -sf --unix-socket "$socket" http://d/_ping >/dev/null 2>&1; then
    mkdir -p "$(dirname "$socket")"
    # The API service lives until the host stops it (time=0: no idle exit).
    nohup podman system service --time=0 "unix://$socket" >/var/log/podman-service.log 2>&1 &
    for _ in $(seq 1 50); do
      curl -sf --unix-socket "$socket" http://d/_ping >/dev/null 2>&1 && break
      sleep 0.2
    done
  fi
  if [ ! -d /run/systemd/system ]; then
    # No systemd to run the containers' health checks: a loop of ours does (one per project).
    pidfile=/run/podman/policyloop-healthchecks-$project.pid
    if ! { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }; then
      nohup docker/podman-healthchecks.sh "$project" >/dev/null 2>&1 &
      echo $! > "$pidfile"
    fi
  fi
  DOCKER_HOST="unix://$socket" exec docker-compose -p "$project" "${env_file[@]}" "${files[@]}" "$@"
fi

if command -v podman-compose >/dev/null; then
  exec podman-compose -p "$project" "${env_file[@]}" "${files[@]}" "$@"
fi
echo "no compose: install docker (with compose) or podman and docker-compose (docker/setup-podman.sh)" >&2
exit 1
