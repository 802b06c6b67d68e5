#!/usr/bin/env bash
# Run the engine adapters' tests (marker `engines`), each in its engine's own cached
# environment (scripts/engine_env.sh makes it when missing: minutes, several GB), and the
# router tests that read the daemon's KV events with a real router's indexer (dynamo:
# tests/routers/dynamo, in an environment of its own too).
#   scripts/test_engines.sh [vllm] [sglang] [lmcache] [dynamo]      default: all four
# Each run also checks that the environment is exactly its lock (tests/packaging/test_locked_env.py).
# Extra pytest arguments: ENGINE_PYTEST_ARGS="-x -k name".
set -euo pipefail
cd "$(dirname "$0")/.."
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang lmcache dynamo)
status=0
for engine in "${engines[@]}"; do
    py=$(scripts/engine_env.sh "$engine")
    tests="tests/adapters/$engine"
    [ "$engine" != dynamo ] || tests=tests/routers/dynamo
    echo "engines: $engine tests ($tests) with $py"
    # CPU-only: vLLM's platform is cpu, nothing reaches a model hub.
    PYTHONPATH="$PWD" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 KVSTORE_LOCK="locks/$engine.txt" \
        "$py" -m pytest -q -p no:cacheprovider ${ENGINE_PYTEST_ARGS:-} "$tests" \
        tests/packaging/test_locked_env.py || status=1
done
exit $status
