#!/usr/bin/env bash
# Make (or check) the cached environment of one engine, outside the checkout:
#   scripts/engine_env.sh vllm|sglang|lmcache     -> prints the environment's python
# Each engine pulls its own CUDA build of torch (6-11 GB), so each has its own venv under
# $KVSTORE_ENGINE_ENVS (default ~/.cache/kvstore-engines), made with uv and one shared uv
# cache (identical wheels are hardlinked between them). A second run only checks.
# kvstore itself is not installed there: tests run the checkout's code (PYTHONPATH).
set -euo pipefail
engine=${1:?usage: scripts/engine_env.sh vllm|sglang|lmcache}
case "$engine" in
    vllm)    spec="vllm==0.33.*" ;;
    sglang)  spec="sglang==0.5.23" ;;
    lmcache) spec="lmcache==0.5.*" ;;
    *) echo "engine_env: unknown engine '$engine' (vllm, sglang or lmcache)" >&2; exit 2 ;;
esac
root=${KVSTORE_ENGINE_ENVS:-$HOME/.cache/kvstore-engines}
env_dir="$root/$engine"
stamp="$env_dir/.kvstore-ready-$spec"
if [ -f "$stamp" ]; then
    echo "$env_dir/bin/python"
    exit 0
fi
mkdir -p "$root"
uv=$(command -v uv || true)
if [ -z "$uv" ]; then
    python3 -m venv "$root/.uv-tool" >&2
    "$root/.uv-tool/bin/pip" install -q --disable-pip-version-check uv >&2
    uv="$root/.uv-tool/bin/uv"
fi
export UV_CACHE_DIR=${UV_CACHE_DIR:-$root/.uv-cache}
echo "engine_env: creating $env_dir with $spec (a CUDA torch: several GB, minutes; cached after)" >&2
rm -rf "$env_dir"
"$uv" venv -q --python 3.11 "$env_dir" >&2 || "$uv" venv -q "$env_dir" >&2
# kvstore's own runtime dependencies and the test runner, beside the engine.
"$uv" pip install --python "$env_dir/bin/python" "$spec" msgpack xxhash aiohttp prometheus-client \
    'rocksdict>=0.3.29' numpy uvloop pytest >&2
if [ "$engine" = vllm ]; then
    # vLLM's connector test utilities (create_vllm_config, create_scheduler, create_request)
    # ship only in its sdist: keep its tests/ beside the environment.
    version=$("$env_dir/bin/python" -c "import importlib.metadata as m; print(m.version('vllm'))")
    tmp=$(mktemp -d)
    python3 -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps "vllm==$version" -d "$tmp" >&2
    mkdir -p "$env_dir/src"
    tar -xzf "$tmp"/vllm-*.tar.gz -C "$env_dir/src" --strip-components=1 "vllm-$version/tests"
    rm -rf "$tmp"
fi
touch "$stamp"
echo "$env_dir/bin/python"
