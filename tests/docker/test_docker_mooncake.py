"""The Mooncake compose cluster (docker/docker-compose.mooncake.yml) built offline and driven
for real: mooncake-master, pool-memory (Mooncake's own mooncake_client lending the pool its
memory) and three kvstore nodes whose remote tier is that pool (`[remote] backend =
"mooncake"`, TCP, P2PHANDSHAKE).

`scripts/docker_cluster.sh --mooncake` builds kvstore's image, then docker/Dockerfile.mooncake's
on top of it (the Mooncake wheel from a wheelhouse prepared on the host, Debian's libibverbs1),
and brings the cluster up; the checks pipe docker_probe.py into `docker exec` as
test_docker_cluster.py does.

Shown: a put on node A reads back bit-exact on node C through the pool (C's lookup says
"remote" first, "host" once the verified read promoted it); a node killed and started again
(empty: host tier only) finds the pool's objects; the master killed (`docker kill`) makes the
pool's objects misses, not errors, while what a node holds locally still reads, and, the
master started again (empty: no HA), the pool takes new objects once pool-memory has mounted
its memory again; down leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from docker_probe import ids
from test_docker_cluster import Compose, running
from test_docker_cluster import _run as run_with

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster"))
from cluster_helpers import wait_until  # noqa: E402

pytestmark = pytest.mark.docker

PROJECT = "kvstoremctest"
ENV = {**os.environ, "KVSTORE_COMPOSE_PROJECT": PROJECT}
NODES = ["node-a", "node-b", "node-c"]
SERVICES = ["mooncake-master", "pool-memory", *NODES]
SIZE = 300_017
SETTLE_S = 60.0
PER_GROUP = 2  # ids(tag, 2): 12 objects


def _run(args: list[str], **kwargs):
    return run_with(args, env=ENV, **kwargs)


class Pool(Compose):
    """The running Mooncake cluster: Compose's container, probe, admin and health, for the
    Mooncake compose file and its test project."""

    def __init__(self):
        super().__init__(("--mooncake",), ENV)

    def pool_up(self, *nodes: str) -> bool:
        return all(self.probe(node, "remote")["pool"]["up"] for node in nodes)

    def tiers(self, node: str, namespace: str, tag: str) -> list:
        return self.probe(node, "tiers", namespace, tag, PER_GROUP)["tiers"]

    def check(self, node: str, namespace: str, tag: str) -> dict:
        return self.probe(node, "check", namespace, tag, PER_GROUP, SIZE)

    def put_into_pool(self, node: str, namespace: str, tag: str, reader: str) -> None:
        """Put the objects on `node` and wait until `reader` sees them in the pool
        (write_through copies each commit there in the background)."""
        assert self.probe(node, "put", namespace, tag, PER_GROUP, SIZE) == {"put": N}
        wait_until(lambda: self.tiers(reader, namespace, tag) == ["remote"] * N, SETTLE_S,
                   f"{reader} sees every object in the pool")

    def restart(self, service: str) -> None:
        _run(["docker", "kill", self.container(service)])
        _run(["docker", "start", self.container(service)])
        wait_until(lambda: self.health(service) == "running/healthy", SETTLE_S, f"{service} healthy again")


N = len(ids("n", PER_GROUP))
EXACT = {"exact": N, "missing": [], "wrong": []}


@pytest.fixture(scope="module")
def pool():
    with running(Pool()) as p:
        # Each daemon sets its Mooncake client up in the background.
        wait_until(lambda: p.pool_up(*NODES), SETTLE_S, "every node's pool client is up")
        yield p


@pytest.fixture(autouse=True)
def save_logs(request):
    """After each test, each container's log, kept in build/docker/logs-mooncake/."""
    yield
    if "pool" in request.fixturenames and shutil.which("docker") is not None:
        Pool().save_logs("logs-mooncake")


def test_put_on_node_a_reads_bit_exact_on_node_c_through_the_pool(pool):
    pool.put_into_pool("node-a", "pool", "p", reader="node-c")
    assert pool.check("node-c", "pool", "p") == EXACT
    assert pool.tiers("node-c", "pool", "p") == ["host"] * N  # promoted, verified
    remote = pool.probe("node-c", "remote")
    assert remote["backend"] == "mooncake" and remote["remote"]["num_hits"] >= N
    assert remote["remote"]["num_checksum_failures"] == 0 and remote["remote"]["num_header_failures"] == 0
    # The operator's view: the pool, reachable, and what the master says it holds.
    doc = pool.admin("node-c", "/v1/cluster")["pool"]
    assert doc["master"] == "mooncake-master:50051" and doc["up"] is True, doc
    assert doc["held"]["keys"] >= N and doc["held"]["capacity_bytes"] == 256 << 20, doc
    for node in NODES:
        assert pool.health(node) == "running/healthy"
        status = _run(["docker", "exec", pool.container(node), "kvstore", "status", "--config",
                       "/etc/kvstore/kvstore.toml", "--json"])
        assert json.loads(status.stdout)["ready"] is True


def test_a_restarted_node_finds_the_pools_objects(pool):
    pool.put_into_pool("node-a", "restart", "r", reader="node-b")
    pool.restart("node-a")  # SIGKILL; its host tier (no NVMe here) starts empty
    wait_until(lambda: pool.pool_up("node-a"), SETTLE_S, "node-a's pool client up again")
    assert pool.tiers("node-a", "restart", "r") == ["remote"] * N
    assert pool.check("node-a", "restart", "r") == EXACT


def test_the_master_killed_gives_misses_not_errors(pool):
    pool.put_into_pool("node-a", "down", "d", reader="node-b")
    _run(["docker", "kill", pool.container("mooncake-master")])
    # node-b never read them: each is a miss (the first call waits for Mooncake's RPC
    # timeout, then the pool is marked down and skipped), and the probe gets no error.
    assert pool.check("node-b", "down", "d") == {"exact": 0, "missing": [str(o) for o in ids("d", PER_GROUP)],
                                                 "wrong": []}
    assert pool.tiers("node-b", "down", "d") == [None] * N
    pool_b = pool.probe("node-b", "remote")["pool"]
    assert pool_b["up"] is False and pool_b["num_pool_failures"] >= 1, pool_b
    assert pool.check("node-a", "down", "d") == EXACT  # its host tier still serves
    assert pool.admin("node-b", "/readyz") == {"ready": True}
    # A put with the master gone succeeds on the node; its copy to the pool fails, counted.
    assert pool.probe("node-a", "put", "lost", "l", PER_GROUP, SIZE) == {"put": N}
    wait_until(lambda: pool.probe("node-a", "remote")["num_put_failures"] >= 1, SETTLE_S, "node-a counts failed puts")
    assert pool.check("node-a", "lost", "l") == EXACT

    # Started again (empty: no HA), the master gets pool-memory's segment back and the
    # nodes' probes find it: the pool takes and serves new objects. (A node that made no
    # call while the master was gone still counts it up; its first call after the restart
    # fails on the old connection, and the probe after it finds the master.)
    _run(["docker", "start", pool.container("mooncake-master")])
    wait_until(lambda: pool.health("mooncake-master") == "running/healthy", SETTLE_S, "the master healthy again")
    wait_until(lambda: pool.pool_up("node-a", "node-b"), SETTLE_S, "node-a's and node-b's pool clients up again")
    wait_until(lambda: (pool.admin("node-a", "/v1/cluster")["pool"]["held"] or {}).get("capacity_bytes", 0) > 0,
               SETTLE_S, "pool-memory's segment mounted again")
    pool.put_into_pool("node-a", "after", "f", reader="node-c")
    assert pool.check("node-c", "after", "f") == EXACT
    # Their copies failed, or (queued behind the failing calls) reached the new master after
    # its restart: each is a miss or reads exact on C, never anything else.
    assert set(pool.tiers("node-c", "lost", "l")) <= {None, "remote"}
    lost = pool.check("node-c", "lost", "l")
    assert lost["wrong"] == [] and lost["exact"] + len(lost["missing"]) == N, lost
    assert pool.tiers("node-c", "down", "d") == [None] * N


def test_down_leaves_nothing_behind(pool):
    pool.down_leaves_nothing(services=len(SERVICES))
