"""Three real daemons (`kvstore serve`), each in its own network namespace, static peer list,
one replica per object.

Shown: an object put on A is read on C bit-exact, whichever node is its home; lookups cross
nodes (tier "remote", counted in the lead and its bytes) and namespaces stay isolated; an
object past its TTL is not served to other nodes; B cut off (link down) while clients read:
reads of B-homed objects are misses, counted as peer failures or skips, while every other
read, put and lookup keeps working; once B's link is back, B serves again.
"""

import contextlib
import threading
import time

import numpy as np
import pytest
from cluster_helpers import key, keys_by_home, payload, read_exact, start_cluster, wait_until

from kvstore.hints import Hints

pytestmark = pytest.mark.cluster

NAMES = ["a", "b", "c"]
SIZE = (1 << 20) + 123  # not a multiple of any page or extent size


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(NAMES, str(tmp_path_factory.mktemp("cluster")), replicas=1, peer_timeout_s=1.0)
    try:
        yield cluster
    finally:
        cluster.close()


def put_all(daemon, namespace, ids):
    with daemon.client(namespace) as c:
        for oid in ids:
            c.put(oid, payload(SIZE, oid))


def lookup_tiers(daemon, namespace, ids) -> tuple:
    with daemon.client(namespace) as c:
        return c.lookup(ids).tiers


def replicated(daemon, namespace, ids):
    """True once `daemon` finds every id somewhere (its homes hold what A replicated to them)."""
    return lambda: None not in lookup_tiers(daemon, namespace, ids)


def test_put_on_a_read_on_c_bit_exact(cluster):
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    homed = keys_by_home("xfer", NAMES, per_node=2)
    ids = homed["a"] + homed["b"] + homed["c"]
    before = c.counters()
    put_all(a, "xfer", ids)
    wait_until(replicated(c, "xfer", ids), 10.0, "C finds every object A put")

    # C holds its own homed objects (A replicated them); the rest live on A and B.
    assert lookup_tiers(c, "xfer", ids) == ("remote",) * 4 + ("host",) * 2
    with b.client("xfer") as cb:
        found = cb.lookup(ids)
    assert found.tiers == ("remote",) * 2 + ("host",) * 2 + ("remote",) * 2
    assert found.hits == 6 and found.hit_bytes == 6 * SIZE  # local hits behind remote ones count too
    with c.client("xfer") as cc:
        for oid in ids:
            assert read_exact(cc, oid, SIZE), oid
        assert cc.lookup(ids).tiers == ("host",) * 6  # fetched copies are published locally
        cc.check_integrity()
        counted = cc.stats()["namespaces"]["xfer"]
    assert (counted["num_gets"], counted["num_hits"], counted["num_misses"]) == (6, 6, 0)
    after = c.counters()  # four fetches from A and B, each verified
    assert after["num_hits"] - before["num_hits"] == 4
    assert after["num_checksum_failures"] == before["num_checksum_failures"]

    # An unknown id is a miss everywhere; another tenant sees none of these objects.
    assert lookup_tiers(b, "xfer", [key("never-put", 0)]) == (None,)
    with b.client("other-tenant") as other:
        assert other.lookup(ids).tiers == (None,) * 6
        assert all(other.get(oid) is None for oid in ids)


def test_an_expired_object_is_not_served_to_other_nodes(cluster):
    a, c = cluster["a"], cluster["c"]
    oid = keys_by_home("ttl", NAMES, per_node=1)["a"][0]  # A is its only home: C must ask A
    ttl_s = 3.0  # room for the first lookup on a slow machine
    with a.client("ttl") as ca:
        ca.put(oid, payload(SIZE, oid), hints=Hints(ttl_s=ttl_s))
    committed = time.monotonic()  # the daemon's TTL started before this
    assert lookup_tiers(c, "ttl", [oid]) == ("remote",)
    time.sleep(max(0.0, committed + ttl_s + 0.1 - time.monotonic()))
    assert lookup_tiers(c, "ttl", [oid]) == (None,)
    with c.client("ttl") as cc:
        assert cc.get(oid) is None
    with a.client("ttl") as ca:
        assert ca.get(oid) is None


class Reader(threading.Thread):
    """A client on C reading A-homed objects over and over while B goes down and comes back;
    it deletes C's fetched copy (scope "node") after each read so every read crosses to A again."""

    def __init__(self, daemon, ids):
        super().__init__(daemon=True)
        self.daemon_, self.ids = daemon, ids
        self.stop = threading.Event()
        self.reads, self.bad = 0, []

    def run(self):
        out = np.empty(SIZE, dtype=np.uint8)
        with self.daemon_.client("cut") as cc:
            while not self.stop.is_set():
                for oid in self.ids:
                    try:
                        got = cc.get_into(oid, out)
                        if got != SIZE or not np.array_equal(out, payload(SIZE, oid)):
                            self.bad.append((oid, got))
                        cc.delete([oid], scope="node")
                        self.reads += 1
                    except Exception as exc:  # reported by the test, not swallowed
                        self.bad.append((oid, repr(exc)))
                        return
                    time.sleep(0.01)  # leave the two shared cores some room


@contextlib.contextmanager
def reading(daemon, ids):
    reader = Reader(daemon, ids)
    reader.start()
    try:
        wait_until(lambda: reader.reads >= 2, 10.0, "the reader gets going")
        yield reader
    finally:
        reader.stop.set()
        reader.join(20.0)


def test_cut_off_node_misses_others_keep_working_then_it_rejoins(cluster):
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    homed = keys_by_home("cut", NAMES, per_node=5)
    looked_up, streamed = homed["a"][:3], homed["a"][3:]
    on_b, on_c = homed["b"][:3], homed["c"][:3]
    put_all(a, "cut", looked_up + streamed + on_b + on_c)
    wait_until(replicated(c, "cut", on_b + on_c), 10.0, "A's puts reach their homes")

    with reading(c, streamed) as reader:
        before = c.counters()
        with cluster.net.cut_off("b"), c.client("cut") as cc:
            # Reads of B-homed objects: misses (the client's own timeout would fail a hang).
            assert [cc.get(oid) for oid in on_b] == [None] * 3
            after = c.counters()
            assert after["num_peer_failures"] > before["num_peer_failures"]  # B noticed, counted
            tried = (after["num_peer_failures"] - before["num_peer_failures"]
                     + after["num_peer_skips"] - before["num_peer_skips"])
            assert tried >= 3 and after["num_misses"] - before["num_misses"] >= 3
            assert "b" in after["peers_down"]
            # Everything else keeps working: A-homed reads, local objects, lookups. Once the
            # skip window (peer_timeout_s) has passed, B is tried again: a miss again, counted.
            time.sleep(cluster.peer_timeout_s + 0.2)
            assert cc.lookup(looked_up + on_b + on_c).tiers == ("remote",) * 3 + (None,) * 3 + ("host",) * 3
            assert cc.get(on_b[0]) is None
            assert c.counters()["num_peer_failures"] > after["num_peer_failures"]
            for oid in looked_up + on_c:
                assert read_exact(cc, oid, SIZE), oid
            # New puts on C replicate to their live homes and read back on A.
            fresh = keys_by_home("cut-fresh", NAMES, per_node=2)
            for oid in fresh["a"] + fresh["c"]:
                cc.put(oid, payload(SIZE, oid))
            wait_until(replicated(a, "cut", fresh["a"] + fresh["c"]), 10.0, "C's new puts reach A")
            with a.client("cut") as ca:
                for oid in fresh["a"] + fresh["c"]:
                    assert read_exact(ca, oid, SIZE), oid
            # B itself keeps serving its local clients while cut off.
            with b.client("cut") as cb:
                for oid in on_b:
                    assert read_exact(cb, oid, SIZE), oid
            assert not reader.bad, reader.bad[:3]
            assert reader.is_alive()

        def b_serves_again():
            with c.client("cut") as cc:
                return read_exact(cc, on_b[0], SIZE)

        wait_until(b_serves_again, 15.0, "C reads B-homed objects after B's link is back")
        with c.client("cut") as cc:
            for oid in on_b[1:]:
                assert read_exact(cc, oid, SIZE), oid
            cc.check_integrity()
        assert "b" not in c.counters()["peers_down"]
        reads_so_far = reader.reads
        wait_until(lambda: reader.reads > reads_so_far, 10.0, "the reader keeps reading after B is back")
    assert not reader.bad, reader.bad[:3]
    assert not reader.is_alive()
    assert c.counters()["num_checksum_failures"] == 0


def test_a_group_put_on_a_is_found_and_read_whole_on_c(cluster):
    """A store group's manifest and members are ordinary objects homed on any node: C finds
    the group complete through its peers and reads every member bit-exact; a member deleted
    cluster-wide makes it incomplete everywhere."""
    from kvstore import StateDescriptor
    from kvstore.identity import chunk_keys
    a, c = cluster["a"], cluster["c"]
    tokens = list(range(4096))
    kv = chunk_keys(tokens, StateDescriptor("groups", "hybrid", "r1", kind="kv"))
    state = chunk_keys(tokens, StateDescriptor("groups", "hybrid", "r1", kind="recurrent", dtype="fp32"))
    groups = [[(kv[i], payload(SIZE, kv[i].object_id)), (state[i], payload(9_000, state[i].object_id))]
              for i in range(6)]
    with a.client("groups") as ca:
        for items in groups:
            assert not ca.put_group(items).existed
    keys = [[k for k, _ in items] for items in groups]

    def complete_on_c():
        with c.client("groups") as cc:
            return cc.lookup_groups(keys).leading == 6
    wait_until(complete_on_c, 10.0, "C finds every group A put")
    with c.client("groups") as cc:
        assert "remote" in cc.lookup_groups(keys).tiers  # some are found only through a peer
        for items in groups:
            with cc.get_group([k for k, _ in items]) as got:
                assert all(np.array_equal(lease.numpy(), data) for lease, (_, data) in zip(got, items))
        assert cc.lookup_groups(keys).tiers == ("host",) * 6  # read whole: every member fetched here
        assert cc.delete([state[2]]) == 1
        assert cc.lookup_groups(keys).complete == (True, True, False, True, True, True)
        assert cc.get_group(keys[2]) is None
        assert cc.stats()["leases"] == 0
        cc.check_integrity()
    with a.client("groups") as ca:
        assert ca.lookup_groups([keys[2]]).complete == (False,)
