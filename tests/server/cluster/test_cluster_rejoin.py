"""Re-homing to a member that comes back while the member list (etcd) never changed: a node
restarted (SIGKILL, then the same node id and address) before its lease ran out, and a node
that stopped answering (SIGSTOP) for less than its lease. Either way it lacks what it is home
to (it lost its memory, or missed the copies made meanwhile), and the nodes holding those
objects must send them. Real daemons on loopback, a real etcd."""

import signal

import numpy as np
from test_cluster_tiers import etcd, etcd_node, local_tiers, members, payload  # noqa: F401 (etcd: a fixture)

from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvs_testing import wait_for

# Far longer than any restart or pause below: B never leaves the list, so only the restart
# (a new registration) or its answering again can tell the others it needs its share.
LEASE_TTL_S = 60.0
SIZE = 64_000


def three_nodes(daemon_factory, etcd, prefix):
    nodes = {n: etcd_node(daemon_factory, etcd, n, replicas=2, prefix=prefix, ttl_s=LEASE_TTL_S) for n in "abc"}
    assert all(wait_for(lambda d=d: members(d) == set("abc"), 15) for d in nodes.values())
    return nodes


def on_homes(nodes, ids, among="abc"):
    """Every id is in the host tier of each of its homes (replicas 2 over "abc") in `among`."""
    return all(local_tiers(nodes[n], [oid]) == ("host",) for oid in ids
               for n in home_nodes(oid, "abc", 2) if n in among)


def rehome_sent(nodes) -> int:
    total = 0
    for name in "ac":
        with nodes[name].client() as c:
            total += c.stats()["tiers"]["remote"]["rehome"]["objects_sent"]
    return total


def test_a_node_restarted_within_its_lease_gets_its_share_back(daemon_factory, etcd):
    nodes = three_nodes(daemon_factory, etcd, "/restart/")
    b = nodes["b"]
    ids = [ObjectId(f"rs-{i}".encode().ljust(32, b".")) for i in range(30)]
    with nodes["a"].client() as ca:
        for oid in ids:
            ca.put(oid, payload(SIZE, oid))
    assert wait_for(lambda: on_homes(nodes, ids), 15)
    mine = [oid for oid in ids if "b" in home_nodes(oid, "abc", 2)]
    assert mine

    b.stop(signal.SIGKILL)
    b.start("32MiB")  # empty (host tier only), registered again under a new lease
    assert wait_for(lambda: members(b) == set("abc"), 15)
    assert wait_for(lambda: local_tiers(b, mine) == ("host",) * len(mine), 15), local_tiers(b, mine)
    assert rehome_sent(nodes) >= len(mine)
    with b.client() as cb:
        for oid in mine:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(SIZE, oid))


def test_a_node_back_from_a_pause_gets_the_copies_it_missed(daemon_factory, etcd):
    nodes = three_nodes(daemon_factory, etcd, "/pause/")
    a, b = nodes["a"], nodes["b"]
    ids = [ObjectId(f"ps-{i}".encode().ljust(32, b".")) for i in range(30)]
    mine = [oid for oid in ids if "b" in home_nodes(oid, "abc", 2)]
    b.proc.send_signal(signal.SIGSTOP)
    try:
        with a.client() as ca:  # A's copies to B time out: B is marked down, they are lost
            for oid in ids:
                ca.put(oid, payload(SIZE, oid))
        assert wait_for(lambda: on_homes(nodes, ids, among="ac"), 15)
        with a.client() as ca:
            assert "b" in ca.stats()["tiers"]["remote"]["remote"]["peers_down"]
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert wait_for(lambda: local_tiers(b, mine) == ("host",) * len(mine), 15), local_tiers(b, mine)
    with b.client() as cb:
        for oid in mine:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(SIZE, oid))
