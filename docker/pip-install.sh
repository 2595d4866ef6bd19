#!/bin/sh
# Installs policyloop (and, for the torch image, torch first) into /opt/venv.
#   pip-install.sh <extras> [torch]
# Build extras (docker/build-extras/, filled by `make images`, optional): ca-certificates/*.crt
# are trusted for the build's downloads only (a proxy's CA; they do not stay in the image), and
# wheels/*.whl are offered to pip before the index (e.g. a torch wheel already on the host).
set -eu
extras=$1
with_torch=${2:-}
extra_dir=/tmp/build-extras

python3 -m venv /opt/venv
if ls "$extra_dir"/ca-certificates/*.crt >/dev/null 2>&1; then
  cat /etc/ssl/certs/ca-certificates.crt "$extra_dir"/ca-certificates/*.crt > /tmp/ca-bundle.pem
  export PIP_CERT=/tmp/ca-bundle.pem
fi
find_links=""
if ls "$extra_dir"/wheels/*.whl >/dev/null 2>&1; then
  find_links="--find-links $extra_dir/wheels"
fi
pip="/opt/venv/bin/pip --no-cache-dir --disable-pip-version-check"

# shellcheck disable=SC2086
$pip install -q --index-url "$PIP_INDEX_URL" --upgrade pip
if [ -n "$with_torch" ]; then
  # torch from its own index (CPU or CUDA build) or a supplied wheel; its dependencies from PyPI.
  # shellcheck disable=SC2086
  $pip install --index-url "$TORCH_INDEX_URL" --extra-index-url "$PIP_INDEX_URL" $find_links "torch==$TORCH_VERSION"
  /opt/venv/bin/python - <<PY
import torch
want = "$TORCH_VARIANT"
has_cuda = torch.version.cuda is not None
print(f"torch {torch.__version__} cuda={torch.version.cuda}")
if (want == "cuda") != has_cuda:
    raise SystemExit(f"TORCH_VARIANT={want} but this torch is {'a CUDA' if has_cuda else 'a CPU-only'} build")
PY
fi
# shellcheck disable=SC2086
$pip install --index-url "$PIP_INDEX_URL" $find_links "/src[$extras]"
/opt/venv/bin/policyloop --help >/dev/null
rm -f /tmp/ca-bundle.pem
