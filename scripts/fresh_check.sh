#!/usr/bin/env bash
# The README's test command as a new machine runs it: a fresh clone of this checkout's HEAD,
# with the engine environments ($KVSTORE_ENGINE_ENVS), the uv cache and pip's cache in empty
# directories, so nothing made by an earlier run can hide a missing install step.
#   scripts/fresh_check.sh [RUNS]      default 1; 2 runs it twice in a row and checks that both
#                                      runs installed the same versions in every environment
# Extra environment passes through (KVSTORE_SKIP_DOCKER=1 and the like). Each run prints its exit
# code and time; its log and each environment's `uv pip freeze` stay under $work/run-N/, and the
# large directories are removed after each run. Needs about 35 GB free and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
case "$runs" in ''|*[!0-9]*|0) echo "fresh_check: RUNS must be a positive whole number, not '$runs'" >&2; exit 2 ;; esac
work=${KVSTORE_FRESH_DIR:-$(mktemp -d /tmp/kvstore-fresh.XXXXXX)}
mkdir -p "$work"
uv=$(scripts/uv.sh)
commit=$(git rev-parse HEAD)  # every run tests this commit, whatever is committed meanwhile
echo "fresh_check: $runs run(s) of ./scripts/test.sh from a clone of ${commit:0:7} under $work"
status=0
for run in $(seq 1 "$runs"); do
    dir="$work/run-$run"
    rm -rf "$dir" && mkdir -p "$dir"
    git clone -q . "$dir/clone" && git -C "$dir/clone" checkout -q "$commit"
    started=$SECONDS
    code=0
    (cd "$dir/clone" && KVSTORE_ENGINE_ENVS="$dir/engines" UV_CACHE_DIR="$dir/uv-cache" PIP_CACHE_DIR="$dir/pip-cache" \
        ./scripts/test.sh) >"$dir/test.log" 2>&1 || code=$?
    echo "fresh_check: run $run: ./scripts/test.sh exit $code in $((SECONDS - started)) s (log: $dir/test.log)"
    [ "$code" = 0 ] || status=1
    for env in "$dir"/engines/*/; do
        [ -x "$env/bin/python" ] && "$uv" pip freeze --python "$env/bin/python" >"$dir/$(basename "$env").txt"
    done
    "$dir/clone/.venv/bin/python" -m pip freeze --exclude-editable >"$dir/main.txt" 2>/dev/null || true
    rm -rf "$dir/clone" "$dir/engines" "$dir/uv-cache" "$dir/pip-cache"
    if [ "$run" -gt 1 ]; then
        for freeze in "$work/run-1"/*.txt; do
            if ! diff -q "$freeze" "$dir/$(basename "$freeze")" >/dev/null; then
                echo "fresh_check: run $run installed other versions than run 1 in $(basename "$freeze" .txt):"
                diff "$freeze" "$dir/$(basename "$freeze")" | head -20 || true
                status=1
            fi
        done
    fi
done
[ "$status" = 0 ] && echo "fresh_check: passed ($runs run(s), same versions in every environment)"
exit $status
