#!/usr/bin/env bash
# The compose cluster (docker/docker-compose.yml: etcd, nodes a, b, c, an engine container),
# built offline: no image registry and no package index inside containers.
#
#   scripts/docker_cluster.sh build   base image, wheelhouse, images (cached: reruns are quick)
#   scripts/docker_cluster.sh up      build, then start the cluster and wait until it is healthy
#   scripts/docker_cluster.sh test    pytest tests/docker (which runs up and down itself) and the
#                                     Kubernetes manifests' wiring run (tests/kubernetes/
#                                     test_kubernetes_wiring.py: the DaemonSet's and engines' pods
#                                     on this engine), then down again and those pods' containers
#                                     removed, whatever happened (a test killed midway)
#   scripts/docker_cluster.sh down    remove the cluster's containers, network and volumes
#   scripts/docker_cluster.sh engine  start dockerd (as root, when none answers) and return
#   scripts/docker_cluster.sh stop-engine   stop the dockerd that `engine` started, if it runs
#   scripts/docker_cluster.sh id SERVICE   the container id of a service (for docker exec/kill)
#
# --mooncake first (`scripts/docker_cluster.sh --mooncake up|test|down|build|id SERVICE`): the
# Mooncake variant instead, docker/docker-compose.mooncake.yml: mooncake-master, pool-memory
# (Mooncake's mooncake_client lending the pool its memory) and nodes a, b, c with
# `[remote] backend = "mooncake"`; its image (docker/Dockerfile.mooncake) adds the
# mooncake-transfer-engine-non-cuda wheel (its own wheelhouse, the version
# locks/main-constraints.txt pins) and Debian's libibverbs1 to kvstore's. Project `kvstoremc`
# (the tests': `kvstoremctest`); `test` runs tests/docker/test_docker_mooncake.py.
#
# Offline means: the base image is Debian bookworm made with debootstrap from the Debian
# mirror (KVSTORE_DEBIAN_MIRROR) and `docker import`; python3 and etcd come from the same
# mirror (apt-get in `docker build --network host`); kvstore's wheel and its dependencies'
# wheels (CPython 3.11, manylinux) are prepared on the host with pip and installed in the
# image with `pip install --no-index --find-links`. Needs root for debootstrap.
#
# The Docker engine: a running one, or (as root) `dockerd --storage-driver=vfs` started here,
# logged to build/docker/dockerd.log and left running (until `stop-engine`). Compose: `docker compose` v2 if the
# CLI has it, else `docker-compose` (Debian's 1.29: apt-get install docker-compose).
set -euo pipefail

MOONCAKE=0
if [ "${1:-}" = --mooncake ]; then MOONCAKE=1; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${KVSTORE_DOCKER_WORK:-$ROOT/build/docker}"
if [ $MOONCAKE = 1 ]; then
    PROJECT="${KVSTORE_COMPOSE_PROJECT:-kvstoremc}"
    COMPOSE_FILE="$ROOT/docker/docker-compose.mooncake.yml"
    SERVICES="mooncake-master pool-memory node-a node-b node-c"
    TESTS=("$ROOT/tests/docker/test_docker_mooncake.py")
    TEST_PROJECT=kvstoremctest  # test_docker_mooncake.py's
else
    PROJECT="${KVSTORE_COMPOSE_PROJECT:-kvstore}"
    COMPOSE_FILE="$ROOT/docker/docker-compose.yml"
    SERVICES="etcd node-a node-b node-c engine"
    TESTS=("$ROOT/tests/docker/test_docker_cluster.py" "$ROOT/tests/kubernetes/test_kubernetes_wiring.py")
    TEST_PROJECT=kvstoretest  # test_docker_cluster.py's
fi
BASE_IMAGE="${KVSTORE_BASE_IMAGE:-kvstore-base:bookworm}"
export KVSTORE_IMAGE="${KVSTORE_IMAGE:-kvstore:latest}"
export KVSTORE_ETCD_IMAGE="${KVSTORE_ETCD_IMAGE:-kvstore-etcd:latest}"
export KVSTORE_MOONCAKE_IMAGE="${KVSTORE_MOONCAKE_IMAGE:-kvstore-mooncake:latest}"
MIRROR="${KVSTORE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECRET="$ROOT/docker/cluster-secret"
UID_IN_IMAGE=10001  # the image's kvstore user (docker/Dockerfile)
UP_TIMEOUT_S=180
# The Docker CLI may be newer than the engine and default to BuildKit (buildx); the classic
# builder is what Debian's engine has.
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0

log() { echo "docker_cluster: $*" >&2; }
die() { log "$*"; exit 1; }

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"

engine() {
    docker info >/dev/null 2>&1 && return 0
    [ "$(id -u)" = 0 ] || die "no Docker engine answers and this is not root (start dockerd, or join the docker group)"
    command -v dockerd >/dev/null || die "no Docker engine answers and dockerd is missing (Debian: apt-get install -y docker.io)"
    mkdir -p "$WORK"
    log "starting dockerd --storage-driver=vfs (log: $WORK/dockerd.log)"
    # setsid: the engine outlives this script and is not in its process group.
    setsid dockerd --storage-driver=vfs >"$WORK/dockerd.log" 2>&1 < /dev/null &
    local pid=$!
    echo $pid > "$WORK/dockerd.pid"
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && return 0
        kill -0 $pid 2>/dev/null || die "dockerd exited: $(tail -n 3 "$WORK/dockerd.log")"
        sleep 1
    done
    die "dockerd did not answer within 60 s; see $WORK/dockerd.log"
}

stop_engine() {
    local pid
    pid="$(cat "$WORK/dockerd.pid" 2>/dev/null)" || { log "no dockerd started here"; return 0; }
    rm -f "$WORK/dockerd.pid"
    [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = dockerd ] || return 0  # gone already (or the pid was reused)
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 30); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 1
    done
    die "dockerd (pid $pid) did not stop within 30 s"
}

compose() {
    if docker compose version >/dev/null 2>&1; then
        docker compose -p "$PROJECT" -f "$COMPOSE_FILE" "$@"
    elif command -v docker-compose >/dev/null; then
        docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" "$@"
    else
        die "neither \`docker compose\` nor docker-compose is installed (Debian: apt-get install -y docker-compose)"
    fi
}

base_image() {
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
    command -v debootstrap >/dev/null || die "debootstrap is missing (Debian: apt-get install -y debootstrap)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to make $BASE_IMAGE"
    local rootfs
    rootfs="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-rootfs.XXXXXX")"
    log "debootstrap --variant=minbase bookworm from $MIRROR"
    if ! debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
        rm -rf "$rootfs"
        die "debootstrap failed; see $WORK/debootstrap.log"
    fi
    chmod 0755 "$rootfs"  # mktemp made it 0700: it becomes the image's /, which every user walks
    tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
}

# The build context: the sources the Dockerfile copies and docker/wheels, nothing else (the
# repository holds .venv and build outputs that must not be sent to the engine).
context() {
    local ctx="$WORK/context" wheels="$WORK/context/docker/wheels"
    rm -rf "$ctx"
    mkdir -p "$ctx"
    (cd "$ROOT" && tar -c --exclude=__pycache__ --exclude=docker/wheels --exclude=docker/cluster-secret \
        pyproject.toml README.md kvstore tiers server client gpu adapters commands docker) | tar -x -C "$ctx"
    mkdir -p "$wheels"
    log "wheelhouse: kvstore and its core dependencies for CPython 3.11"
    # A fixed timestamp inside the wheel: unchanged sources give the same bytes, and the
    # image layers stay cached.
    # setuptools builds in the tree and reuses what build/lib holds: an earlier layout's
    # packages there would ride along into the wheel
    rm -rf "$ROOT/build/lib" "$ROOT"/build/bdist.*
    SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel -q --no-deps "$ROOT" -w "$wheels" >"$WORK/pip.log" 2>&1 \
        || die "pip wheel failed; see $WORK/pip.log"
    # The versions .venv has (locks/main-constraints.txt), so every image holds what the tests
    # ran against; the images are Debian 12 (glibc 2.36), so manylinux_2_28 wheels fit them.
    "$PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -c "$ROOT/locks/main-constraints.txt" \
        -d "$wheels" "$wheels"/kvstore-*.whl >>"$WORK/pip.log" 2>&1 \
        || die "pip download failed; see $WORK/pip.log"
}

# The Mooncake image's context: its Dockerfile and wheels/ (the Mooncake wheel and its
# dependencies', CPython 3.11; kvstore's own are in the image it builds on).
mooncake_context() {
    local ctx="$WORK/context-mooncake"
    rm -rf "$ctx"
    mkdir -p "$ctx/wheels"
    cp "$ROOT/docker/Dockerfile.mooncake" "$ctx/"
    log "wheelhouse: mooncake-transfer-engine-non-cuda for CPython 3.11"
    "$PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -c "$ROOT/locks/main-constraints.txt" \
        -d "$ctx/wheels" mooncake-transfer-engine-non-cuda >"$WORK/pip-mooncake.log" 2>&1 \
        || die "pip download failed; see $WORK/pip-mooncake.log"
}

secret() {
    [ -s "$SECRET" ] && return 0
    "$PY" -c 'import secrets; print(secrets.token_hex(24))' > "$SECRET"
    if [ "$(id -u)" = 0 ]; then  # readable by the containers' kvstore user only
        chown "$UID_IN_IMAGE:$UID_IN_IMAGE" "$SECRET"
        chmod 0600 "$SECRET"
    else  # the containers' user must read it; each daemon warns (event=secret_file_readable)
        chmod 0644 "$SECRET"
    fi
}

# The images our tags name now. A rebuild moves a tag to a new image and leaves the old one
# untagged, and each build leaves its build stage's image; under the vfs storage driver each
# keeps a full copy of its layers (0.5-0.7 GB), so repeated test runs filled a 250 GB disk.
# drop_untagged removes those, and only those (the build stages carry org.kvstore.stage=build).
image_ids() {
    local tag
    for tag in "$@"; do docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true; done
}

drop_untagged() {  # drop_untagged "ids": the ones that no tag names any more
    local id
    for id in $1; do
        [ "$(docker image inspect -f '{{len .RepoTags}}' "$id" 2>/dev/null)" = 0 ] || continue
        docker image rm "$id" >/dev/null 2>&1 || log "kept the replaced image $id (a container still uses it)"
    done
    docker image prune -f --filter label=org.kvstore.stage=build >/dev/null
}

build() {
    engine
    mkdir -p "$WORK"
    base_image
    context
    local before
    before="$(image_ids "$KVSTORE_IMAGE" "$KVSTORE_ETCD_IMAGE" "$KVSTORE_MOONCAKE_IMAGE")"
    if [ $MOONCAKE = 1 ]; then
        mooncake_context
        log "building $KVSTORE_IMAGE and $KVSTORE_MOONCAKE_IMAGE (log: $WORK/build-mooncake.log)"
        {
            docker build --network host --build-arg BASE="$BASE_IMAGE" --build-arg WHEELS=docker/wheels \
                -t "$KVSTORE_IMAGE" -f "$WORK/context/docker/Dockerfile" "$WORK/context" \
            && docker build --network host --build-arg KVSTORE_IMAGE="$KVSTORE_IMAGE" -t "$KVSTORE_MOONCAKE_IMAGE" \
                -f "$WORK/context-mooncake/Dockerfile.mooncake" "$WORK/context-mooncake"
        } >"$WORK/build-mooncake.log" 2>&1 || die "docker build failed; see $WORK/build-mooncake.log"
        drop_untagged "$before"
        return 0
    fi
    log "building $KVSTORE_ETCD_IMAGE and $KVSTORE_IMAGE (log: $WORK/build.log)"
    {
        docker build --network host --build-arg BASE="$BASE_IMAGE" -t "$KVSTORE_ETCD_IMAGE" \
            -f "$WORK/context/docker/Dockerfile.etcd" "$WORK/context/docker" \
        && docker build --network host --build-arg BASE="$BASE_IMAGE" --build-arg WHEELS=docker/wheels \
            -t "$KVSTORE_IMAGE" -f "$WORK/context/docker/Dockerfile" "$WORK/context"
    } >"$WORK/build.log" 2>&1 || die "docker build failed; see $WORK/build.log"
    drop_untagged "$before"
    secret
}

healthy() {  # every service but the engine reports healthy, the engine runs
    local id state
    for service in $SERVICES; do
        id="$(compose ps -q "$service" 2>/dev/null)"
        [ -n "$id" ] || return 1
        state="$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")"
        case "$state" in
            "running healthy" | "running ") ;;
            *) return 1 ;;
        esac
    done
}

up() {
    build
    compose up -d --no-build >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; die "compose up failed"; }
    local deadline=$((SECONDS + UP_TIMEOUT_S))
    until healthy; do
        if [ $SECONDS -gt $deadline ]; then
            compose ps >&2 || true
            compose logs --tail=30 >&2 || true
            die "the cluster is not healthy within $UP_TIMEOUT_S s"
        fi
        sleep 1
    done
    if [ $MOONCAKE = 1 ]; then
        log "up: mooncake-master, pool-memory, node-a, node-b, node-c healthy (project $PROJECT)"
    else
        log "up: etcd, node-a, node-b, node-c healthy; engine running (project $PROJECT)"
    fi
}

leftovers() {  # what of the project exists (none, or no engine: nothing)
    docker info >/dev/null 2>&1 || return 0
    local filter="label=com.docker.compose.project=$PROJECT"
    docker ps -aq --filter "$filter"; docker network ls -q --filter "$filter"; docker volume ls -q --filter "$filter"
}

# The containers of the Kubernetes wiring run (tests/kubernetes/pod_to_docker.py labels them).
WIRING_LABEL=org.kvstore.test=kubernetes-wiring
remove_wiring() {
    docker info >/dev/null 2>&1 || return 0
    local ids
    ids="$(docker ps -aq --filter "label=$WIRING_LABEL")"
    [ -z "$ids" ] || { log "removing the Kubernetes wiring run's containers"; docker rm -f -v $ids >/dev/null; }
}

down() {
    docker info >/dev/null 2>&1 || { log "no Docker engine answers: nothing runs"; return 0; }
    compose down --volumes --remove-orphans --timeout 30 >"$WORK/down.log" 2>&1 \
        || { cat "$WORK/down.log" >&2; die "compose down failed"; }
    local left
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
    [ -z "$left" ] || die "containers left after down: $left"
}

case "${1:-}" in
    engine) engine ;;
    stop-engine) stop_engine ;;
    build) build ;;
    up) up ;;
    down) mkdir -p "$WORK"; down ;;
    id) compose ps -q "${2:?usage: $0 id SERVICE}" ;;
    test)
        shift
        mkdir -p "$WORK"
        PROJECT=$TEST_PROJECT
        # The tests' fixture takes the cluster down; this covers a run cut short (SIGTERM,
        # Ctrl-C) before the fixture could.
        trap 'remove_wiring; if [ -n "$(leftovers)" ]; then log "taking down what the test run left of $PROJECT"; down; fi' EXIT
        trap 'exit 143' TERM
        trap 'exit 130' INT
        "$PY" -m pytest -q -m docker "${TESTS[@]}" "$@" ;;
    *) die "usage: $0 [--mooncake] up|test|down|build|engine|stop-engine|id SERVICE" ;;
esac
