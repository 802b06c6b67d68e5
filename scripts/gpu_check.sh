#!/usr/bin/env bash
# The prepared GPU check: on a machine with CUDA, in under 10 minutes,
#   1. find (or install) a Python whose torch sees CUDA,
#   2. run the gpu-marked tests, then the small kernel tests on the device,
#   3. run the kernel benchmark,
# and leave logs and JSON under $OUT (default ./gpu-out):
#   env.txt  nvidia-smi.txt  pytest-gpu.{log,xml}  pytest-kernels.{log,xml}  pytest-vllm-gpu.log  bench.log
#   kernels.json  summary.json
# Exit status: 0 when every step passed. Each step has its own time limit so a hang in one
# still leaves the others' results. With CUDA torch, triton and pytest already on the machine
# the steps take a few minutes (mostly Triton compiles); the device machines reach no package
# index, so the install branch only helps where one is reachable. There, wheels made by
# scripts/gpu_wheels.sh in $GPU_WHEELS (default .whl) are installed first: the daemon's and the
# tests' packages that a CUDA image lacks (rocksdict, pyzmq, gguf, ucxx for CUDA 13).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
started=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # project packages without an install
WHEELS="${GPU_WHEELS:-.whl}"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE="${TMPDIR:-/tmp}/kvstore-gpu-site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$SITE" || echo "installing the wheels in $WHEELS failed"
fi

has_cuda_torch() {
  "$1" - <<'EOF' 2>/dev/null
import sys, torch, triton, pytest
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
}

# 1. a Python with CUDA torch, triton and pytest: $PYTHON, the checkout's venv, the machine's,
#    or a fresh venv outside the checkout (needs the package index).
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null && has_cuda_torch "$candidate" && { PY="$candidate"; break; }
done
gpu_present() { command -v nvidia-smi >/dev/null || ls /dev/nvidia0 >/dev/null 2>&1; }
if [ -z "$PY" ] && ! gpu_present; then
  echo "no NVIDIA device on this machine: nothing to check (the CPU suite is pytest tests/gpu)"
elif [ -z "$PY" ]; then
  VENV="${VENV:-${TMPDIR:-/tmp}/kvstore-gpu-venv}"
  echo "no Python with CUDA torch found; installing into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
  timeout 300 "$VENV/bin/pip" install -q -e '.[test]' triton || echo "install failed"
  has_cuda_torch "$VENV/bin/python" && PY="$VENV/bin/python"
fi

{
  date -u +%FT%TZ
  uname -a
  echo "python: ${PY:-none}"
  [ -n "$PY" ] && "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "device", torch.cuda.get_device_name(0))'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not available" > "$OUT/nvidia-smi.txt"

rc_gpu=127; rc_kernels=127; rc_bench=127; rc_vllm=127
if [ -n "$PY" ]; then
  # 2. the gpu-marked tests (real shapes), then the interpreter-sized tests on the device
  #    (the GPU tier: GpuCopies on the real device, an engine process reading its copies by CUDA IPC)
  timeout 210 "$PY" -m pytest -m gpu tests/gpu tests/client/test_pinning.py tests/tiers/test_gpu_copies.py \
    tests/client/test_gpu_mapping.py -q -rA -p no:cacheprovider \
    --junitxml="$OUT/pytest-gpu.xml" > "$OUT/pytest-gpu.log" 2>&1
  rc_gpu=$?
  tail -n 25 "$OUT/pytest-gpu.log"
  timeout 180 "$PY" -m pytest -m "not gpu" tests/gpu -q -rA -p no:cacheprovider \
    --junitxml="$OUT/pytest-kernels.xml" > "$OUT/pytest-kernels.log" 2>&1
  rc_kernels=$?
  tail -n 5 "$OUT/pytest-kernels.log"
  # 2b. the vLLM connector over CUDA paged caches (pinned staging), where a Python with vLLM
  #     is on the machine ($VLLM_PYTHON or scripts/engine_env.sh's cached environment; the
  #     device machines reach no package index, so it cannot be installed there)
  VPY="${VLLM_PYTHON:-$HOME/.cache/kvstore-engines/vllm/bin/python}"
  if [ -x "$VPY" ] && "$VPY" -c 'import vllm, torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    HF_HUB_OFFLINE=1 timeout 150 "$VPY" -m pytest -m "engines and gpu" tests/adapters/vllm -q -rA \
      -p no:cacheprovider > "$OUT/pytest-vllm-gpu.log" 2>&1
    rc_vllm=$?
    tail -n 5 "$OUT/pytest-vllm-gpu.log"
  else
    rc_vllm=0
    echo "not run: no Python with vLLM and CUDA torch on this machine ($VPY)" | tee "$OUT/pytest-vllm-gpu.log"
  fi
  # 3. kernel bandwidth against a device-to-device copy
  timeout 150 "$PY" bench/kernels.py --out "$OUT/kernels.json" > "$OUT/bench.log" 2>&1
  rc_bench=$?
  cat "$OUT/bench.log"
fi

elapsed=$(( $(date +%s) - started ))
cat > "$OUT/summary.json" <<EOF
{"python": "${PY:-none}", "pytest_gpu_rc": $rc_gpu, "pytest_kernels_rc": $rc_kernels, "bench_rc": $rc_bench, "vllm_gpu_rc": $rc_vllm, "seconds": $elapsed}
EOF
cat "$OUT/summary.json"
[ "$rc_gpu" -eq 0 ] && [ "$rc_kernels" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_vllm" -eq 0 ]
