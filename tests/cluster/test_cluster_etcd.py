"""Three real daemons in network namespaces whose membership lives in a real etcd (on the hub),
two replicas per object.

Shown: every daemon registers and sees all three; B cut off leaves the member list once its
lease runs out, and objects put meanwhile go to the live nodes; once its link is back B
registers again, receives the objects put meanwhile that it is now home to (re-homing; a
store group put meanwhile is whole from B), and takes its share of new objects; a copy that fails its checksum is
refused and the next home serves; with two replicas, SIGKILL of B loses no object: every
object put on any node (B included) reads back bit-exact on A and C, both while B is still
listed (its reads fail over to the other home) and after it has left.
"""

import pytest
from cluster_helpers import keys_by_homes, payload, read_exact, start_cluster, wait_until

from kvstore.ownership import home_nodes

pytestmark = pytest.mark.cluster

NAMES = ["a", "b", "c"]
TTL_S = 2.0
# A member leaves once etcd expires its lease (TTL, checked about every 0.5 s); the others see
# that through their watch or the 1 s resync. A generous bound: this waits, it does not time.
LEAVE_WAIT_S = TTL_S + 8.0
SIZE = 256 * 1024 + 17


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(NAMES, str(tmp_path_factory.mktemp("cluster-etcd")), replicas=2, etcd=True,
                            lease_ttl_s=TTL_S, peer_timeout_s=1.0)
    try:
        yield cluster
    finally:
        cluster.close()


def group_members(namespace):
    """A chunk's KV and the recurrent state at its end, as an engine stores them together."""
    from kvstore import StateDescriptor
    from kvstore.identity import chunk_keys
    tokens = list(range(256))
    return [chunk_keys(tokens, StateDescriptor(namespace, "hybrid", "r1", kind=kind))[0]
            for kind in ("kv", "recurrent")]


def sees(daemon, members):
    return lambda: daemon.members() == set(members)


def held_by_homes(cluster, namespace, ids, members):
    """True once every id is in the host tier of each of its homes among `members`."""
    def check():
        for name in members:
            mine = [oid for oid in ids if name in home_nodes(oid, members, 2)]
            with cluster[name].client(namespace) as c:
                if c.lookup(mine).tiers != ("host",) * len(mine):
                    return False
        return True
    return check


def test_cut_off_member_leaves_and_rejoins(cluster):
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    for name in NAMES:
        wait_until(sees(cluster[name], NAMES), 5.0, f"{name} sees all three")

    with cluster.net.cut_off("b"):
        wait_until(sees(a, "ac"), LEAVE_WAIT_S, "A drops B")
        wait_until(sees(c, "ac"), LEAVE_WAIT_S, "C drops B")
        # With B gone the two live nodes are the homes of everything: a put on A lands on C.
        ids = [oid for group in keys_by_homes("gone", NAMES, 2, replicas=2).values() for oid in group]
        with a.client("gone") as ca:
            for oid in ids:
                ca.put(oid, payload(SIZE, oid))
            group = [(k, payload(SIZE, k.object_id)) for k in group_members("gone")]
            ca.put_group(group)  # a store group's manifest and members re-home as any object
        wait_until(held_by_homes(cluster, "gone", ids, ["a", "c"]), 10.0, "A's puts reach C")
        with c.client("gone") as cc:
            for oid in ids:
                assert read_exact(cc, oid, SIZE), oid
        assert c.counters()["num_peer_failures"] == 0  # nobody asked B: it is not a member

    for name in NAMES:
        wait_until(sees(cluster[name], NAMES), LEAVE_WAIT_S, f"{name} sees B again")
    # Re-homing: what was put while B was away and is homed on B now reaches B, from A or C.
    wait_until(held_by_homes(cluster, "gone", ids, NAMES), 15.0, "objects put while B was away reach B")
    with b.client("gone") as cb:
        for oid in ids:
            if "b" in home_nodes(oid, NAMES, 2):
                assert cb.lookup([oid]).tiers == ("host",) and read_exact(cb, oid, SIZE), oid
    assert sum(cluster[n].cluster_stats()["rehome"]["objects_sent"] for n in "ac") >= 1
    with b.client("gone") as cb:  # the group put while B was away is whole from B, and reads whole
        keys = [k for k, _ in group]
        assert cb.lookup_groups([keys]).complete == (True,)
        with cb.get_group(keys) as got:
            assert all(bytes(lease.numpy()) == bytes(data) for lease, (_, data) in zip(got, group))
    # B takes its share of new objects again: puts on C replicate to B (and A); B reads them all.
    groups = keys_by_homes("back", NAMES, 1, replicas=2)
    ids = [oid for group in groups.values() for oid in group]
    with c.client("back") as cc:
        for oid in ids:
            cc.put(oid, payload(SIZE, oid))
    wait_until(held_by_homes(cluster, "back", ids, NAMES), 10.0, "C's puts reach B and A")
    with b.client("back") as cb:
        for oid in ids:
            assert read_exact(cb, oid, SIZE), oid


def test_a_corrupt_copy_is_refused_and_the_next_home_serves(cluster):
    """Bytes from a peer are verified before they are published: B's copy, corrupted in place,
    is refused on C, which falls back to the second home A; the refused landing frees its room."""
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    groups = keys_by_homes("rot", NAMES, 1, replicas=2)
    good, bad = groups[("a", "b")][0], groups[("b", "a")][0]
    with a.client("rot") as ca:
        for oid in (good, bad):
            ca.put(oid, payload(SIZE, oid))
    wait_until(held_by_homes(cluster, "rot", [good, bad], NAMES), 10.0, "both objects on both homes")
    with b.client("rot") as cb:  # flip one byte of B's copy through B's shared arena
        lease = cb.get(bad)
        arena = cb.core.arenas["rot"]
        arena[lease.numpy().ctypes.data - arena.ctypes.data + 1000] ^= 0xFF
        lease.release()
    before = c.counters()["num_checksum_failures"]
    with c.client("rot") as cc:
        assert read_exact(cc, good, SIZE)
        one = cc.stats()["namespaces"]["rot"]["used_bytes"]
        assert read_exact(cc, bad, SIZE)  # B's bytes refused, A's served
        assert cc.stats()["namespaces"]["rot"]["used_bytes"] == 2 * one  # nothing left behind
        cc.check_integrity()
    assert c.counters()["num_checksum_failures"] == before + 1


def test_two_replicas_survive_sigkill_of_one_node(cluster):
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    for name in NAMES:
        wait_until(sees(cluster[name], NAMES), LEAVE_WAIT_S, f"{name} sees all three")
    # Two ids for every ordered pair of homes, put round-robin from A, B and C.
    ids = [oid for group in keys_by_homes("rep", NAMES, 2, replicas=2).values() for oid in group]
    for i, oid in enumerate(ids):
        with cluster[NAMES[i % 3]].client("rep") as cl:
            cl.put(oid, payload(SIZE, oid))
    wait_until(held_by_homes(cluster, "rep", ids, NAMES), 10.0, "every object on both its homes")

    b.kill()
    # B is still listed until its lease runs out: reads on C of objects whose first home is B
    # fail over to the second home. Nothing is lost.
    with c.client("rep") as cc:
        for oid in ids:
            assert read_exact(cc, oid, SIZE), oid
        assert cc.lookup(ids).tiers == ("host",) * len(ids)
    assert c.counters()["num_peer_failures"] + c.counters()["num_peer_skips"] >= 1

    wait_until(sees(a, "ac"), LEAVE_WAIT_S, "A drops the killed B")
    wait_until(sees(c, "ac"), LEAVE_WAIT_S, "C drops the killed B")
    with a.client("rep") as ca:
        assert None not in ca.lookup(ids).tiers
        for oid in ids:
            assert read_exact(ca, oid, SIZE), oid
        ca.check_integrity()
    assert a.counters()["num_checksum_failures"] == 0
