#!/usr/bin/env bash
# Builds policyloop's images with docker, or podman where no Docker engine runs (`make images`).
#
#   docker/build-images.sh                       # policyloop-light:latest, policyloop-torch:latest (CPU)
#   TORCH_VARIANT=cuda docker/build-images.sh    # policyloop-torch:cuda (CUDA torch on a CUDA base)
#   IMAGE_PREFIX=registry.example.com/rl/ TAG=0.1.0 docker/build-images.sh   # then push them
#
# Environment (all optional): CONTAINER_ENGINE (docker|podman), IMAGE_PREFIX, TAG, TORCH_VARIANT,
# BASE_IMAGE, TORCH_BASE_IMAGE, PIP_INDEX_URL, TORCH_INDEX_URL, TORCH_WHEEL (a torch wheel file to
# install instead of downloading one), NATS_IMAGE, REDIS_IMAGE.
#
# Where no image registry is reachable, the official bases cannot be pulled: the script then
# makes a Debian base with debootstrap (docker/debian-base.sh) and builds NATS and Redis images
# from Debian's packages. It writes the image names compose should use to docker/images.env.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
cd "$(dirname "$0")/.."

engine=${CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  else echo "neither a Docker engine nor podman is available (see docker/setup-podman.sh)" >&2; exit 1
  fi
fi
format=()
[ "$engine" = podman ] && format=(--format docker)   # keeps HEALTHCHECK

prefix=${IMAGE_PREFIX:-}
variant=${TORCH_VARIANT:-cpu}
tag=${TAG:-latest}
torch_tag=$tag
[ "$variant" = cuda ] && torch_tag=${TAG:-cuda}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
revision=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain 2>/dev/null)" ]; then revision="$revision-dirty"; fi

image_present() { "$engine" image inspect "$1" >/dev/null 2>&1; }
# True when the image is here or can be pulled within a short while.
image_available() {
  image_present "$1" && return 0
  timeout 120 "$engine" pull -q "$1" >/dev/null 2>&1
}

# Makes the Debian base unless it is here. Called as a command, never in $(...): what it and
# debian-base.sh print is progress for the user (on stderr), not a value.
debian_base=localhost/debian:bookworm
ensure_debian_base() {
  image_present "$debian_base" && return 0
  echo "building $debian_base with debootstrap (no registry reachable)" >&2
  CONTAINER_ENGINE=$engine DEBIAN_BASE_TAG=$debian_base docker/debian-base.sh bookworm >&2
}

official_python=python:3.11-slim-bookworm
base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
  if image_available "$official_python"; then base=$official_python
  else
    echo "$official_python cannot be pulled: building on $debian_base"
    ensure_debian_base
    base=$debian_base
  fi
fi
if [ "$variant" = cuda ]; then
  official_cuda=nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04
  torch_base=${TORCH_BASE_IMAGE:-$official_cuda}
  # The CUDA torch build on PyPI carries its CUDA libraries; the download.pytorch.org indexes
  # (e.g. .../whl/cu129) work too.
  torch_index=${TORCH_INDEX_URL:-https://pypi.org/simple}
else
  torch_base=${TORCH_BASE_IMAGE:-$base}
  torch_index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
fi
pip_index=${PIP_INDEX_URL:-https://pypi.org/simple}

# Build-only extras: the host's extra CA certificates (a TLS-intercepting proxy's) and a torch
# wheel already on the host. They stay in the build stages, not in the images.
extras=docker/build-extras
rm -rf "$extras"
mkdir -p "$extras/ca-certificates" "$extras/wheels"
touch "$extras/.keep"
for crt in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$crt" ] && cp "$crt" "$extras/ca-certificates/"
done
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile)
wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ] && [ "$variant" = cpu ]; then
  # pip's find-links directories (PIP_FIND_LINKS or pip config), as `pip install torch` here sees them.
  links="${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true)"
  for dir in $links; do
    for candidate in "$dir"/torch-"$torch_version"+cpu-*.whl; do
      [ -f "$candidate" ] && wheel=$candidate && break 2
    done
  done
fi
if [ -n "$wheel" ]; then
  cp "$wheel" "$extras/wheels/"
  echo "torch from $(basename "$wheel")"
  # The wheel is offered beside the index; PyPI's index then supplies only torch's dependencies.
  [ -z "${TORCH_INDEX_URL:-}" ] && torch_index=$pip_index
fi

common=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_BASE_IMAGE=$torch_base"
        --build-arg "PIP_INDEX_URL=$pip_index" --build-arg "TORCH_INDEX_URL=$torch_index"
        --build-arg "TORCH_VARIANT=$variant" --build-arg "VERSION=$version"
        --build-arg "GIT_REVISION=$revision")
light=${prefix}policyloop-light:$tag
torch=${prefix}policyloop-torch:$torch_tag
echo "building $light and $torch with $engine (base $base, torch $variant on $torch_base)"
"$engine" build "${format[@]}" -f docker/Dockerfile --target light -t "$light" "${common[@]}" .
"$engine" build "${format[@]}" -f docker/Dockerfile --target torch -t "$torch" "${common[@]}" .

# NATS and Redis: the official images where they can be pulled, else the same servers from Debian.
nats=${NATS_IMAGE:-nats:2.9-alpine}
redis=${REDIS_IMAGE:-redis:7-alpine}
if ! image_available "$nats"; then
  nats=${prefix}policyloop-nats:debian
  ensure_debian_base
  "$engine" build "${format[@]}" -f docker/nats.Dockerfile --build-arg "BASE_IMAGE=$debian_base" -t "$nats" docker
fi
if ! image_available "$redis"; then
  redis=${prefix}policyloop-redis:debian
  ensure_debian_base
  "$engine" build "${format[@]}" -f docker/redis.Dockerfile --build-arg "BASE_IMAGE=$debian_base" -t "$redis" docker
fi

cat > docker/images.env <<ENV
# Written by docker/build-images.sh: the images compose uses (compose --env-file docker/images.env).
POLICYLOOP_LIGHT_IMAGE=$light
POLICYLOOP_TORCH_IMAGE=$torch
NATS_IMAGE=$nats
REDIS_IMAGE=$redis
ENV
cat docker/images.env
