#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine that reaches no package index: run this
# where pip works, copy the folder beside the checkout there (or carry it), and gpu_check.sh
# installs it before its first step. A CUDA machine's Python usually holds torch, triton,
# numpy, pytest, aiohttp, msgpack, xxhash and uvloop; these are the rest of what the daemon and
# the gpu tests import (UCX's CUDA 13 build for the GPUDirect test, with its RAPIDS pieces).
#
#   scripts/gpu_wheels.sh [DIR]      # DIR defaults to .whl; PYVER=3.12 for the target's CPython
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PYVER="${PYVER:-3.12}"
mkdir -p "$DIR"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DIR" \
  "rocksdict>=0.3.29" "pyzmq>=25" "gguf>=0.10" \
  "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" \
  "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" "rapids-logger==0.3.*"
du -sh "$DIR"
echo "wheels in $DIR for CPython $PYVER: scripts/gpu_check.sh installs them (GPU_WHEELS=$DIR)"
