#!/usr/bin/env bash
# Idempotent set-up on Debian/Ubuntu: system packages, a virtualenv in .venv,
# torch (CPU build) and pffs with its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need=()
for pkg in fuse3 libfuse3-dev pkg-config rsync zstd python3-venv python3-dev gcc; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
# An editable install in setuptools' compat mode: a .pth line puts the
# checkout on sys.path.  The default mode's import finder costs every Python
# start, every `pffs` command included, about 25 ms (a user's plain install
# has neither).
if ! .venv/bin/python -c "import pffs, pyfuse3, pytest, hypothesis, safetensors" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.pffs-installed ] \
   || ls .venv/lib/python3*/site-packages/__editable___pffs_*_finder.py >/dev/null 2>&1; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]" \
        --config-settings editable_mode=compat
    touch .venv/.pffs-installed
fi
