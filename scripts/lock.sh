#!/usr/bin/env bash
# Refresh the lock files in locks/ from pyproject.toml and locks/*.in:
#   scripts/lock.sh [vllm] [sglang] [lmcache] [dynamo] [main]      default: all five
# locks/<engine>.txt   every package of that engine's (or router's) test environment, exact, with hashes
#                      (scripts/engine_env.sh installs it with --require-hashes)
# locks/main-constraints.txt
#                      versions of everything in .venv (scripts/setup.sh passes it to pip as
#                      constraints; no hashes: torch is the CPU wheel found on this machine's disk)
# locks/overrides.txt constrains every resolution (why: see the file).
#
# When: after changing pyproject's dependencies, an engine's version range or an .in file, or
# to take newer releases on purpose. Then run ./scripts/test.sh: an engine environment whose lock
# changed is made anew (its stamp names the lock's hash). Resolution is for CPython 3.11 on
# x86_64 Linux with glibc 2.36 (Debian 12), whatever machine runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=$(scripts/uv.sh)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(vllm sglang lmcache dynamo main)
compile() {
    local out=$1
    shift
    "$uv" pip compile -q --custom-compile-command "scripts/lock.sh" --python-version 3.11 \
        --python-platform x86_64-manylinux_2_36 -c locks/overrides.txt -o "$out" "$@"
}
for target in "${targets[@]}"; do
    case "$target" in
        vllm|sglang|lmcache|dynamo)
            echo "lock: locks/$target.txt" >&2
            compile "locks/$target.txt" --generate-hashes pyproject.toml locks/engine-tests.in --extra "$target" ;;
        main)
            echo "lock: locks/main-constraints.txt" >&2
            links=()
            [ -d /opt/wheels ] && links=(--find-links /opt/wheels)  # the CPU torch, where the machine has it
            compile locks/main-constraints.txt "${links[@]}" pyproject.toml locks/main.in \
                --extra engine --extra gpu --extra test --extra bench --extra mooncake
            # pip's constraints match torch==2.13.0 against 2.13.0+cpu, not the reverse.
            sed -i -E 's/^(torch==[^+ ]+)\+[A-Za-z0-9.]+/\1/' locks/main-constraints.txt ;;
        *) echo "lock: unknown target '$target' (vllm, sglang, lmcache, dynamo or main)" >&2; exit 2 ;;
    esac
done
