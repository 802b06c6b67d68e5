#!/usr/bin/env bash
# Make (or check) the cached environment of one engine, outside the checkout:
#   scripts/engine_env.sh vllm|sglang|lmcache|dynamo     -> prints the environment's python
# (dynamo is a router, not an engine: Dynamo's KV indexer, 0.3 GB and no torch, read by
# tests/routers/dynamo; it lives here for the same reason, a lock of its own.)
# Each engine pulls its own CUDA build of torch (6-11 GB), so each has its own venv under
# $KVSTORE_ENGINE_ENVS (default ~/.cache/kvstore-engines), made with uv (scripts/uv.sh: one
# pinned version) and one shared uv cache ($UV_CACHE_DIR, default $KVSTORE_ENGINE_ENVS/.uv-cache;
# identical wheels are hardlinked between the environments).
# The environment is exactly locks/<engine>.txt, installed with --require-hashes: every machine
# gets the same versions, whatever the index serves today. Its stamp names the lock's sha256, so a
# refreshed lock (scripts/lock.sh) makes the environment anew; otherwise a second run only checks.
# kvstore itself is not installed there: tests run the checkout's code (PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${1:?usage: scripts/engine_env.sh vllm|sglang|lmcache|dynamo}
case "$engine" in
    vllm|sglang|lmcache|dynamo) ;;
    *) echo "engine_env: unknown engine '$engine' (vllm, sglang, lmcache or dynamo)" >&2; exit 2 ;;
esac
lock="$PWD/locks/$engine.txt"
root=${KVSTORE_ENGINE_ENVS:-$HOME/.cache/kvstore-engines}
env_dir="$root/$engine"
stamp="$env_dir/.kvstore-lock-$(sha256sum "$lock" | cut -c1-16)"
if [ -f "$stamp" ]; then
    echo "$env_dir/bin/python"
    exit 0
fi
mkdir -p "$root"
uv=$(scripts/uv.sh)
export UV_CACHE_DIR=${UV_CACHE_DIR:-$root/.uv-cache}
echo "engine_env: creating $env_dir from locks/$engine.txt (a CUDA torch: several GB, minutes; cached after)" >&2
started=$SECONDS
rm -rf "$env_dir"
"$uv" venv -q --python 3.11 "$env_dir" >&2
"$uv" pip sync -q --require-hashes --python "$env_dir/bin/python" "$lock" >&2
if [ "$engine" = vllm ]; then
    # vLLM's connector test utilities (create_vllm_config, create_scheduler, create_request)
    # ship only in its sdist: keep its tests/ beside the environment. The sdist is fetched as a
    # file and checked against the lock's hashes; nothing is built.
    version=$("$env_dir/bin/python" -c "import importlib.metadata as m; print(m.version('vllm'))")
    tmp=$(mktemp -d)
    archive=$(python3 scripts/fetch_sdist.py vllm "$version" "$lock" "$tmp")
    mkdir -p "$env_dir/src"
    tar -xzf "$archive" -C "$env_dir/src" --strip-components=1 "vllm-$version/tests"
    rm -rf "$tmp"
fi
touch "$stamp"
echo "engine_env: $engine ready in $((SECONDS - started)) s" >&2
echo "$env_dir/bin/python"
