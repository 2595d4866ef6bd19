#!/bin/sh
# The operating-system layer of every policyloop image, on whichever base it is built (the
# official python image, a plain Debian or Ubuntu, an NVIDIA CUDA image): a Python that can make
# a virtual environment, CA certificates for pip, bubblewrap and setpriv for the sandbox, tini as
# PID 1 (reaps the job processes the services start), and the unprivileged `policyloop` user that
# owns the data directories (named volumes take their ownership from the image).
set -eu

packages="ca-certificates bubblewrap util-linux tini"
if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
  packages="$packages python3 python3-venv"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $packages
rm -rf /var/lib/apt/lists/*
command -v bwrap && command -v setpriv && command -v tini
python3 --version

groupadd --system --gid 10001 policyloop
useradd --system --uid 10001 --gid 10001 --home-dir /home/policyloop --create-home --shell /usr/sbin/nologin policyloop
mkdir -p /models /data/weights /data/checkpoints /data/rollout-weights /data/evaluator-weights
chown policyloop:policyloop /models /data/weights /data/checkpoints /data/rollout-weights /data/evaluator-weights
