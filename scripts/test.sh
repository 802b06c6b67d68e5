#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite, then the engine adapters' tests
# in each engine's own cached environment (scripts/test_engines.sh; the first run makes
# those environments: several GB and minutes each). Extra arguments go to the main pytest
# run. KVSTORE_SKIP_ENGINES=1 skips the engine tests (and says so). The Docker cluster tests
# (marker docker: they build images and start containers) are not in this run yet; run them
# with `scripts/docker_cluster.sh test` or `.venv/bin/python -m pytest -m docker tests/docker`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
status=0
.venv/bin/python -m pytest -q -m "not slow and not engines and not docker" \
    --ignore=tests/adapters/vllm --ignore=tests/adapters/sglang --ignore=tests/adapters/lmcache "$@" || status=$?
if [ "${KVSTORE_SKIP_ENGINES:-0}" = 1 ]; then
    echo "test: KVSTORE_SKIP_ENGINES=1: the vLLM, SGLang and LMCache adapter tests did not run"
else
    scripts/test_engines.sh || status=1
fi
exit $status
