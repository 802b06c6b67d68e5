#!/usr/bin/env bash
# Print the path of a uv of the pinned version, installing it beside the engine environments
# when the one on PATH is missing or of another version. The locks (scripts/lock.sh) and the
# engine environments (scripts/engine_env.sh) are made with this one version, so a machine that
# has an older or newer uv on PATH still resolves and installs exactly as the last one did.
set -euo pipefail
UV_VERSION=0.13.9
if command -v uv >/dev/null && [ "$(uv --version | cut -d' ' -f2)" = "$UV_VERSION" ]; then
    command -v uv
    exit 0
fi
tool="${KVSTORE_ENGINE_ENVS:-$HOME/.cache/kvstore-engines}/.uv-$UV_VERSION"
if [ ! -x "$tool/bin/uv" ]; then
    echo "uv: installing uv $UV_VERSION into $tool" >&2
    rm -rf "$tool"
    python3 -m venv "$tool" >&2
    "$tool/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" >&2
fi
echo "$tool/bin/uv"
