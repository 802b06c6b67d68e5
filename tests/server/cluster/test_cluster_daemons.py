"""Two real daemons on loopback forming a cluster (static membership, TCP): state crosses
nodes only as verified transfers between owners."""

import signal
import time

import numpy as np
import pytest

from kvstore import Hints
from kvstore.dtypes import DType
from kvstore.errors import Conflict, InvalidArgument, RangeError
from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvs_testing import free_port, payload, wait_for

SECRET = "a-cluster-secret-of-some-length"


def static_pair(daemon_factory, **config):
    """Daemons a and b in a static two-node cluster on loopback, each with `config` too."""
    ports = {"a": free_port(), "b": free_port()}
    peers = [f"{n}=127.0.0.1:{p}" for n, p in ports.items()]

    def cluster(node):
        return {**config, "cluster": {"enabled": True, "node_id": node, "listen": f"127.0.0.1:{ports[node]}",
                                      "peers": peers, "secret": SECRET, "peer_timeout_s": 1.0}}

    return daemon_factory("32MiB", config=cluster("a")), daemon_factory("32MiB", config=cluster("b"))


@pytest.fixture
def pair(daemon_factory):
    return static_pair(daemon_factory)


def test_put_on_one_node_read_on_the_other_bit_exact(pair):
    a, b = pair
    keys = [ObjectId(bytes([i]) * 32) for i in range(12)]
    with a.client() as ca, b.client() as cb:
        for i, key in enumerate(keys):
            ca.put(key, payload(300_000 + i, i))
        # Objects homed on b are replicated there in the background; the rest stay on a.
        assert wait_for(lambda: cb.lookup(keys).hits == 12)
        tiers = cb.lookup(keys).tiers
        assert set(tiers) <= {"host", "remote"} and "remote" in tiers
        for i, key in enumerate(keys):
            out = np.empty(300_000 + i, np.uint8)
            assert cb.get_into(key, out) == out.size, f"object {i}"
            assert np.array_equal(out, payload(300_000 + i, i))
        assert cb.lookup(keys).tiers == ("host",) * 12  # fetched copies are now local
        ca.check_integrity()
        cb.check_integrity()
        remote = cb.stats()["tiers"]["remote"]
        assert sorted(remote["members"]) == ["a", "b"]
        assert remote["remote"]["num_hits"] >= 1 and remote["remote"]["num_checksum_failures"] == 0


def test_a_fetched_copy_expires_when_the_object_does(pair):
    """hints.ttl_s counts from the put on every node: a copy fetched from the home later
    expires with the home's, not ttl_s after the fetch."""
    a, b = pair
    candidates = [ObjectId(bytes([200, i]) * 16) for i in range(40)]
    key = next(k for k in candidates if home_nodes(k, ("a", "b")) == ["a"])
    with a.client() as ca, b.client() as cb:
        put_at = time.monotonic()
        ca.put(key, payload(20_000, 1), hints=Hints(ttl_s=3.0))
        time.sleep(max(0.0, put_at + 1.5 - time.monotonic()))
        out = np.empty(20_000, np.uint8)
        assert cb.get_into(key, out) == 20_000 and np.array_equal(out, payload(20_000, 1))
        assert cb.lookup([key]).tiers == ("host",)  # b's own copy now
        time.sleep(max(0.0, put_at + 3.6 - time.monotonic()))
        # ttl_s from the fetch would keep b's copy until about 4.5 s after the put
        assert cb.lookup([key]).tiers == (None,) and cb.get(key) is None
        cb.check_integrity()


def test_dead_peer_is_a_fast_miss_and_local_state_keeps_working(pair):
    a, b = pair
    with a.client() as ca:
        for i in range(40):  # some are homed on a only, some on b
            ca.put(ObjectId(bytes([100 + i]) * 32), payload(10_000, i))
    with b.client(timeout_s=5) as cb:
        local = ObjectId(b"\x07" * 32)
        cb.put(local, payload(5000, 7))
        a.stop(signal.SIGKILL)
        # Objects homed on b were replicated there before a died; a's own are misses, not
        # hangs: the client's own 5 s timeout would fail this test first.
        misses = [cb.get(ObjectId(bytes([100 + i]) * 32)) for i in range(40)]
        assert any(m is None for m in misses) and any(m is not None for m in misses)
        remote = cb.stats()["tiers"]["remote"]["remote"]
        assert remote["num_peer_failures"] >= 1  # the dead peer was noticed and counted
        for m in misses:
            if m is not None:
                assert m.verify()
                m.release()
        with cb.get(local) as lease:
            assert np.array_equal(lease.numpy(), payload(5000, 7))
        cb.check_integrity()


def test_wrong_secret_gets_nothing(daemon_factory):
    port_a, port_b = free_port(), free_port()
    peers = [f"a=127.0.0.1:{port_a}", f"b=127.0.0.1:{port_b}"]
    a = daemon_factory("16MiB", config={"cluster": {"enabled": True, "node_id": "a", "listen": f"127.0.0.1:{port_a}",
                                                    "peers": peers, "secret": SECRET}})
    b = daemon_factory("16MiB", config={"cluster": {"enabled": True, "node_id": "b", "listen": f"127.0.0.1:{port_b}",
                                                    "peers": peers, "secret": "another-secret-entirely-x"}})
    keys = [ObjectId(bytes([i]) * 32) for i in range(20)]
    with a.client() as ca, b.client() as cb:
        for i, key in enumerate(keys):
            ca.put(key, payload(4096, i))
        time.sleep(0.5)
        assert cb.lookup(keys).hits == 0
        assert all(cb.get(k) is None for k in keys)


def test_ranged_get_fetches_only_the_ranges_and_keeps_nothing(pair):
    a, b = pair
    size, pairs = 1 << 20, [(700_000, 8192), (0, 4096), (4000, 200)]  # unsorted, overlapping
    packed = sum(n for _, n in pairs)
    candidates = (ObjectId(bytes([200 + i]) * 32) for i in range(40))
    only_on_a = [k for k in candidates if home_nodes(k, ("a", "b")) == ["a"]][:3]
    assert len(only_on_a) == 3
    with a.client() as ca, b.client() as cb:
        for i, k in enumerate(only_on_a):
            ca.put(k, payload(size, i))
        used = cb.stats()["tiers"]["host"]["used_bytes"]
        for i, k in enumerate(only_on_a):
            lease = cb.get(k, ranges=pairs)
            assert lease.tier == "remote" and lease.ranges == tuple(pairs) and lease.size == packed
            assert lease.verify()
            with pytest.raises(InvalidArgument, match=r"read\(offset, length\)"):
                lease.numpy()  # packed ranges here, the whole object on a node that holds it: refused on both
            for offset, length in pairs:
                assert np.array_equal(lease.read(offset, length), payload(size, i)[offset:offset + length])
            cb.check_integrity()  # the leased landing place is accounted for
            lease.release()
        stats = cb.stats()
        assert stats["tiers"]["host"]["objects"] == 0 and stats["tiers"]["host"]["used_bytes"] == used
        assert stats["leases"] == 0 and stats["tiers"]["remote"]["remote"]["bytes_in"] == 3 * packed
        with pytest.raises(InvalidArgument, match=r"\[1048575, 1048577\) reaches past the object's 1048576 bytes"):
            cb.get(only_on_a[0], ranges=[(size - 1, 2)])
        stored = ca.get(only_on_a[0]).descriptor.dtype
        assert cb.get(only_on_a[0], ranges=pairs, accept=[d for d in DType if d != stored][:1]) is None
        assert cb.get(ObjectId(b"\x09" * 32), ranges=pairs) is None
        with ca.get(only_on_a[0], ranges=pairs) as whole:  # held here: leased whole, read the same way
            assert whole.ranges is None and whole.size == size
            with pytest.raises(InvalidArgument, match=r"read\(offset, length\)"):
                whole.numpy()
            assert np.array_equal(whole.read(700_000, 8192), payload(size, 0)[700_000:708_192])
        with b.client() as dies:
            assert dies.get(only_on_a[1], ranges=pairs) is not None  # left leased when the client goes
        assert wait_for(lambda: cb.stats()["leases"] == 0)
        assert cb.stats()["tiers"]["host"]["used_bytes"] == used
        cb.check_integrity()


def test_ranged_miss_under_memory_pressure_evicts_nothing(pair):
    """B's arena (32 MiB) is nearly full of its own objects; ranged gets that miss, or whose
    ranges do not fit, must not make room: room is taken only for a verified hit."""
    a, b = pair
    mine = [ObjectId(bytes([60 + i]) * 32) for i in range(6)]
    with b.client() as cb:
        for i, k in enumerate(mine):
            cb.put(k, payload(5 << 20, i))
        before = cb.stats()["tiers"]["host"]
        candidates = (ObjectId(bytes([120 + i]) * 32) for i in range(20))
        missing = [k for k in candidates if home_nodes(k, ("a", "b")) == ["a"]]
        assert cb.get(missing[0], ranges=[(0, 1 << 20)] * 8) is None  # 8 MiB asked of nothing
        with pytest.raises(RangeError, match="reaches past the object's 5242880 bytes"):
            cb.get(mine[0], ranges=[(5 << 20, 1)])  # held here: the same error as for a remote one
        assert cb.stats()["tiers"]["host"] == before
        for i, k in enumerate(mine):
            with cb.get(k) as lease:
                assert np.array_equal(lease.numpy(), payload(5 << 20, i))
        cb.check_integrity()


def test_pins_reach_the_home_and_hold_its_copy_through_eviction(pair):
    a, b = pair
    candidates = (ObjectId(bytes([150 + i]) * 32) for i in range(40))
    target = next(k for k in candidates if home_nodes(k, ("a", "b")) == ["a"])

    def flood(ca, tag):  # 64 MiB through A's 32 MiB arena: everything unpinned is evicted
        for i in range(64):
            ca.put(ObjectId(f"{tag}-{i}".encode().ljust(32, b".")), payload(1 << 20, 1000 + i))

    with a.client() as ca, b.client() as cb:
        ca.put(target, payload(1 << 20, 5))
        assert cb.pin([target], scope="node") == 0  # B holds no copy of its own
        assert cb.pin([target]) == 1  # the home's copy
        flood(ca, "first")
        assert ca.lookup([target]).tiers == ("host",)
        with cb.get(target, ranges=[(0, 4096)]) as lease:  # still served from A
            assert np.array_equal(lease.read(0, 4096), payload(1 << 20, 5)[:4096])
        assert cb.unpin([target]) == 1 and cb.unpin([target]) == 0
        flood(ca, "second")
        assert ca.lookup([target]).tiers == (None,)
        remote = cb.stats()["tiers"]["remote"]["remote"]
        assert remote["num_pins"] == 3 and remote["num_peer_failures"] == 0
        ca.check_integrity()


def test_an_unpin_from_any_node_reaches_every_pinned_copy(pair):
    a, b = pair
    candidates = [ObjectId(bytes([170 + i]) * 32) for i in range(40)]
    on_a = [k for k in candidates if home_nodes(k, ("a", "b")) == ["a"]][:2]
    with a.client() as ca, b.client() as cb:
        ca.put(on_a[0], payload(4096, 1))
        with cb.get(on_a[0]):  # B now holds a fetched copy of its own
            pass
        assert cb.pin([on_a[0]]) == 1  # B's copy and the home's
        assert ca.unpin([on_a[0]]) == 1  # from A, which is the only home
        assert cb.unpin([on_a[0]], scope="node") == 0  # B's copy was unpinned too
        # A put that asks to be pinned keeps that pin on the home that holds it for B.
        put = cb.put(on_a[1], payload(4096, 2), hints=Hints(pin=True), tier="remote")
        assert put.homes == ("a",) and put.tier == "remote"
        assert ca.unpin([on_a[1]], scope="node") == 1


def homed_only_on_b() -> ObjectId:
    return next(k for k in (ObjectId(bytes([150 + i]) * 32) for i in range(40)) if home_nodes(k, ("a", "b")) == ["b"])


def test_a_home_refuses_a_put_of_its_id_with_another_size(pair):
    a, b = pair
    key = homed_only_on_b()
    with a.client() as ca, b.client() as cb:
        assert ca.put(key, payload(8192, 1), tier="remote").tier == "remote"  # held by b alone
        with pytest.raises(Conflict, match="already stored with 8192 bytes, not 4096"):
            ca.put(key, payload(4096, 2), tier="remote")  # a holds no copy: b's answer is the client's
        assert ca.stats()["tiers"]["host"]["objects"] == 0  # nor does a keep the refused one
        with ca.get(key) as lease, cb.get(key) as on_b:  # b kept the state it had
            assert np.array_equal(lease.numpy(), payload(8192, 1)) and on_b.size == 8192
        ca.check_integrity()


def test_a_reader_expecting_another_descriptor_misses_what_a_home_holds(pair):
    a, b = pair
    key = homed_only_on_b()
    with a.client() as ca, b.client() as cb:
        assert ca.put(key, payload(8192, 1), tier="remote").tier == "remote"  # held by b alone
        with cb.get(key) as lease:
            stored = lease.descriptor
        other = stored.with_(model="another-model")
        assert ca.lookup([key], expect=stored).tiers == ("remote",)
        assert ca.lookup([key], expect=other).tiers == (None,)  # the home's answer is checked too
        hits = ca.stats()["namespaces"]["default"]["num_hits"]
        assert ca.get(key, ranges=[(0, 16)], expect=other) is None  # only those bytes would travel
        assert ca.stats()["namespaces"]["default"]["num_hits"] == hits  # a miss here, no lease
        assert ca.get(key, expect=other) is None
        with ca.get(key, expect=stored) as lease:
            assert np.array_equal(lease.numpy(), payload(8192, 1))


def test_a_read_on_a_node_without_the_namespace_fetches_it_and_a_miss_makes_no_arena(pair):
    """Reads create no arena (only puts do), except where a peer's object needs one to land in."""
    a, b = pair
    key, absent = ObjectId(b"\x07" * 32), ObjectId(b"\x08" * 32)
    with a.client(namespace="only-a") as ca, b.client(namespace="only-a") as cb:
        # the miss first: once a holds the object, replication to its homes (b, maybe) in the
        # background would make b an arena for it whenever it lands
        assert cb.get(absent) is None
        assert "only-a" not in cb.stats()["namespaces"]
        ca.put(key, payload(200_000, 7))
        out = np.empty(200_000, np.uint8)
        assert wait_for(lambda: cb.get_into(key, out) == out.size)
        assert np.array_equal(out, payload(200_000, 7))
        assert "only-a" in cb.stats()["namespaces"]


def test_a_ranged_read_on_a_node_without_the_namespace_fetches_only_its_ranges(pair):
    """A sparse reader's first get in a namespace new to this node: the home's ranges land
    staged, the arena is made once they came (leased, never published), and a ranged miss
    makes none."""
    a, b = pair
    candidates = (ObjectId(bytes([120 + i]) * 32) for i in range(40))
    key, absent = [k for k in candidates if home_nodes(k, ("a", "b")) == ["a"]][:2]
    size, pairs = 300_000, [(200_000, 4096), (4096, 1000)]
    with a.client(namespace="sparse-a") as ca, b.client(namespace="sparse-a") as cb:
        assert cb.get(absent, ranges=pairs) is None
        assert "sparse-a" not in cb.stats()["namespaces"]
        ca.put(key, payload(size, 9))
        lease = cb.get(key, ranges=pairs)
        assert lease.tier == "remote" and lease.ranges == tuple(pairs) and lease.verify()
        for offset, length in pairs:
            assert np.array_equal(lease.read(offset, length), payload(size, 9)[offset:offset + length])
        lease.release()
        stats = cb.stats()
        assert "sparse-a" in stats["namespaces"] and stats["namespaces"]["sparse-a"]["objects"] == 0
        cb.check_integrity()
