"""Three nodes in network namespaces whose membership lives in a real etcd (on the hub).

Shown: every node sees all three; B cut off leaves the member list within its lease TTL and
its objects re-home to live nodes; once its link is back it registers again and rejoins.
"""

import pytest
from cluster_helpers import etcd_in_hub, expected_digest, seeds_by_home, start_cluster, wait_until

pytestmark = pytest.mark.cluster

NAMES = ["a", "b", "c"]
TTL_S = 2.0
# etcd checks lease expiry about every 0.5 s; the watch reports at once; polling is 0.1 s here.
MARGIN_S = 1.5
SIZE = 256 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("cluster-etcd"))
    net, nodes = start_cluster(NAMES, workdir, ttl_s=TTL_S, start_etcd=etcd_in_hub(workdir))
    try:
        yield net, nodes
    finally:
        net.close()


def members(node) -> set:
    return set(node.cmd(op="members")["members"])


def test_members_register_leave_within_ttl_and_rejoin(cluster):
    net, nodes = cluster
    for node in nodes.values():
        wait_until(lambda node=node: members(node) == set(NAMES), 3.0, f"{node.name} sees all nodes")
    seeds = seeds_by_home(NAMES, "ns", SIZE, per_node=2)
    b_homed = seeds["b"]

    net.set_link("b", up=False)
    try:
        noticed = wait_until(lambda: members(nodes["a"]) == {"a", "c"}, TTL_S + MARGIN_S, "A drops B")
        wait_until(lambda: members(nodes["c"]) == {"a", "c"}, 0.5, "C drops B")
        # With B gone, its objects have live homes: a put on A and a get on C work again.
        for seed in b_homed:
            put = nodes["a"].cmd(op="put", seed=seed, size=SIZE)
            assert "b" not in put["homes"]
            got = nodes["c"].cmd(op="get", seed=seed, size=SIZE)
            assert got["found"] and got["digest"] == expected_digest("ns", seed, SIZE)
    finally:
        net.set_link("b", up=True)
    wait_until(lambda: members(nodes["a"]) == set(NAMES), TTL_S + MARGIN_S, "B registers again")
    assert noticed <= TTL_S + MARGIN_S
    assert nodes["b"].cmd(op="homes", seed=b_homed[0], size=SIZE)["homes"] == ["b"]
