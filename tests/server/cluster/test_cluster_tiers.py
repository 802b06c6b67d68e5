"""Real daemons on loopback: the remote tier as a tier. Puts with tier="remote", demotion to
home nodes when objects leave a node's last tier (host only, and host + NVMe), deletes that
reach every member, and re-homing when membership (a real etcd) changes."""

import signal

import numpy as np
import pytest
from peer_helpers import etcd_server, free_port

from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvs_testing import payload, wait_for
from test_cluster_daemons import SECRET

MiB = 1 << 20


def ids_homed(tag: str, members, want: tuple, count: int, replicas: int = 1) -> list[ObjectId]:
    """`count` ids whose home nodes (best first) are exactly `want`."""
    out, i = [], 0
    while len(out) < count:
        oid = ObjectId(bytes(f"{tag}-{i}".encode()).ljust(32, b"."))
        if tuple(home_nodes(oid, members, replicas)) == want:
            out.append(oid)
        i += 1
    return out


def local_tiers(daemon, ids, namespace="default"):
    """Tiers of `ids` as `daemon` answers: its own tier when it holds one, else "remote" when
    a home peer holds it (a node asks nobody about ids homed only on itself)."""
    with daemon.client(namespace=namespace) as c:
        return c.lookup(ids).tiers


def static_cluster(daemon_factory, arenas: dict, **cluster):
    ports = {name: free_port() for name in arenas}
    peers = [f"{n}=127.0.0.1:{p}" for n, p in ports.items()]
    extra = cluster.pop("extra", {})
    return [daemon_factory(arena, config={
        "cluster": {"enabled": True, "node_id": name, "listen": f"127.0.0.1:{ports[name]}", "peers": peers,
                    "secret": SECRET, "peer_timeout_s": 1.0, **cluster}, **extra.get(name, {})})
        for name, arena in arenas.items()]


def test_put_tier_remote_lands_on_its_home_and_leaves_no_local_copy(daemon_factory):
    a, b = static_cluster(daemon_factory, {"a": "32MiB", "b": "32MiB"})
    on_b = ids_homed("rb", "ab", ("b",), 6)
    on_a = ids_homed("ra", "ab", ("a",), 3)
    with a.client() as ca, b.client() as cb:
        for oid in on_b + on_a:
            result = ca.put(oid, payload(300_000, oid), tier="remote")
            assert result.homes == (home_nodes(oid, "ab")[0],)
            assert result.tier == ("remote" if oid in on_b else "host")
        # B holds its objects (it asks nobody for ids homed on itself); A kept only its own.
        assert cb.lookup(on_b).tiers == ("host",) * 6
        assert ca.lookup(on_b).tiers == ("remote",) * 6
        assert ca.lookup(on_a).tiers == ("host",) * 3
        assert ca.stats()["namespaces"]["default"]["objects"] == 3
        for oid in on_b:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(300_000, oid))
        counters = ca.stats()["tiers"]["remote"]
        assert counters["num_remote_puts"] == 9 and counters["num_remote_put_fallbacks"] == 0
        ca.check_integrity()
        cb.check_integrity()


def test_put_tier_remote_keeps_the_object_when_no_home_can_take_it(daemon_factory):
    a, b = static_cluster(daemon_factory, {"a": "32MiB", "b": "32MiB"})
    oid = ids_homed("fb", "ab", ("b",), 1)[0]
    b.stop(signal.SIGKILL)
    with a.client(timeout_s=10) as ca:
        result = ca.put(oid, payload(100_000, oid), tier="remote")
        assert result.tier == "host" and result.homes == ()  # says where it really is
        with ca.get(oid) as lease:
            assert np.array_equal(lease.numpy(), payload(100_000, oid))
        assert ca.stats()["tiers"]["remote"]["num_remote_put_fallbacks"] == 1


def test_put_tier_remote_needs_a_cluster(daemon):
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="cluster.enabled"):
            c.put(b"k" * 32, b"x" * 100, tier="remote")
        with pytest.raises(InvalidArgument, match="put tier"):
            c.put(b"k" * 32, b"x" * 100, tier="nvme")
        assert c.lookup([b"k" * 32]).hits == 0  # nothing half-stored


def test_write_back_sends_objects_to_their_home_when_they_leave_the_host_tier(daemon_factory):
    """A has room for 6 objects and no NVMe: under write_back nothing travels at put; the
    objects A evicts go to B (their home) first, so every one stays readable from A."""
    a, b = static_cluster(daemon_factory, {"a": "8MiB", "b": "48MiB"}, remote_write="write_back")
    ids = ids_homed("wb", "ab", ("b",), 20)
    with a.client() as ca, b.client() as cb:
        for oid in ids[:4]:
            ca.put(oid, payload(MiB, oid))
        assert cb.lookup(ids[:4]).tiers == (None,) * 4  # write_back: nothing sent yet
        for oid in ids[4:]:
            ca.put(oid, payload(MiB, oid))
        on_a = [t == "host" for t in local_tiers(a, ids)]
        on_b = [t == "host" for t in cb.lookup(ids).tiers]
        assert sum(on_a) <= 8 and all(x or y for x, y in zip(on_a, on_b)), (on_a, on_b)
        counters = ca.stats()["tiers"]["remote"]
        assert counters["num_demoted_remote"] == sum(not x for x in on_a) >= 12
        assert counters["num_demotion_failures"] == 0
        for oid in ids:  # evicted ones come back from B, verified
            out = np.empty(MiB, np.uint8)
            assert ca.get_into(oid, out) == MiB
            assert np.array_equal(out, payload(MiB, oid))
        ca.check_integrity()
        cb.check_integrity()


def test_nvme_evictions_go_to_the_home_node(daemon_factory):
    """Host 4 MiB, NVMe 8 MiB on A: objects flow host -> NVMe -> B. None is lost."""
    nvme = {"nvme": {"enabled": True, "capacity_bytes": "8MiB", "file_bytes": "8MiB", "admit_min_hits": 0}}
    a, b = static_cluster(daemon_factory, {"a": "4MiB", "b": "64MiB"}, remote_write="write_back",
                          extra={"a": nvme})
    ids = ids_homed("nv", "ab", ("b",), 24)
    with a.client() as ca, b.client() as cb:
        for oid in ids:
            ca.put(oid, payload(MiB, oid))
        here = local_tiers(a, ids)
        at_b = cb.lookup(ids).tiers
        assert all(t in ("host", "nvme") or u == "host" for t, u in zip(here, at_b)), (here, at_b)
        assert ca.stats()["tiers"]["nvme"]["num_nvme_evictions"] >= 1
        assert ca.stats()["tiers"]["remote"]["num_demoted_remote"] >= 12
        for oid in ids:
            out = np.empty(MiB, np.uint8)
            assert ca.get_into(oid, out) == MiB
            assert np.array_equal(out, payload(MiB, oid))
        ca.check_integrity()


def test_delete_reaches_every_member(daemon_factory):
    a, b = static_cluster(daemon_factory, {"a": "32MiB", "b": "32MiB"})
    ids = ids_homed("del", "ab", ("b",), 4) + ids_homed("del", "ab", ("a",), 4)
    keep = ids_homed("keep", "ab", ("b",), 2)
    with a.client() as ca, b.client() as cb:
        for oid in ids + keep:
            ca.put(oid, payload(50_000, oid))
        assert wait_for(lambda: cb.lookup(ids[:4] + keep).tiers == ("host",) * 6)
        for oid in ids[4:]:  # B caches A's objects too
            with cb.get(oid):
                pass
        assert ca.delete(ids) == 8
        assert cb.lookup(ids).hits == 0 and ca.lookup(ids).tiers == (None,) * 8
        assert all(cb.get(oid) is None for oid in ids)
        assert cb.lookup(keep).tiers == ("host",) * 2  # nothing else went
        assert ca.delete(ids) == 0


def test_admin_cluster_lists_members_and_the_remote_view(daemon_factory):
    from kvstore.server.admin.client import AdminClient
    a, b = static_cluster(daemon_factory, {"a": "16MiB", "b": "16MiB"}, replicas=2)
    api = AdminClient.from_data_dir(a.data_dir)
    doc = api.get("/v1/cluster")
    assert doc["self"] == "a" and doc["nodes"][0]["node_id"] == "a"
    assert [(m["node_id"], m["self"], m["down"]) for m in doc["members"]] == [("a", True, False), ("b", False, False)]
    assert doc["replicas"] == 2 and doc["remote_write"] == "write_through" and doc["rehome"]["passes"] == 0
    b.stop(signal.SIGKILL)
    with a.client() as ca:  # a read homed on B notices it is gone
        assert ca.get(ids_homed("adm", "ab", ("b", "a"), 1, replicas=2)[0]) is None
    assert [m["down"] for m in api.get("/v1/cluster")["members"]] == [False, True]
    from prometheus_client.parser import text_string_to_metric_families
    text = api.request("GET", "/metrics", raw=True)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("kvstore_cluster_member_up", (("node", "a"),))] == 1
    assert samples[("kvstore_cluster_member_up", (("node", "b"),))] == 0
    assert samples[("kvstore_peer_failures_total", ())] >= 1
    assert samples[("kvstore_remote_misses_total", ())] == 1
    assert samples[("kvstore_remote_ranged_gets_total", ())] == 0
    assert samples[("kvstore_rehome_passes_total", ())] == 0


# --- re-homing -----------------------------------------------------------------------------

TTL_S = 2.0


@pytest.fixture
def etcd(tmp_path):
    with etcd_server(str(tmp_path)) as url:
        yield url


def etcd_node(daemon_factory, etcd, name, arena="32MiB", replicas=1, prefix="/rehome/", extra=None, ttl_s=TTL_S):
    return daemon_factory(arena, config={"cluster": {
        "enabled": True, "node_id": name, "listen": f"127.0.0.1:{free_port()}", "secret": SECRET,
        "membership": "etcd", "etcd_endpoint": etcd, "etcd_prefix": prefix, "lease_ttl_s": ttl_s,
        "replicas": replicas, "peer_timeout_s": 1.0, "rehome_delay_s": 0.2}, **(extra or {})})


def members(daemon) -> set:
    with daemon.client() as c:
        return set(c.stats()["tiers"]["remote"]["members"])


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_a_joining_node_receives_the_objects_it_is_now_home_to(daemon_factory, etcd, where):
    """A (alone, so home to all) holds 40 objects, in host memory or mostly on NVMe (a 1 MiB
    host tier); B joins and receives exactly its share, read and verified from A's tiers."""
    nvme = {"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "64MiB"}}
    a = etcd_node(daemon_factory, etcd, "a", *(("1MiB",) if where == "nvme" else ()),
                  extra=nvme if where == "nvme" else None)
    ids = [ObjectId(f"join-{i}".encode().ljust(32, b".")) for i in range(40)]
    with a.client() as ca:
        for oid in ids:
            ca.put(oid, payload(64_000, oid))  # A is the only member: home to all
        if where == "nvme":
            assert local_tiers(a, ids).count("nvme") >= 20
    b = etcd_node(daemon_factory, etcd, "b")
    mine = [oid for oid in ids if home_nodes(oid, "ab") == ["b"]]
    assert 5 <= len(mine) <= 35
    assert wait_for(lambda: members(a) == {"a", "b"}, 15)
    assert wait_for(lambda: local_tiers(b, mine) == ("host",) * len(mine), 15)

    def rehome():
        with a.client() as ca:
            return ca.stats()["tiers"]["remote"]["rehome"]
    # B may show an object just before A counts the reply: wait for the pass to end.
    assert wait_for(lambda: rehome()["objects_sent"] == len(mine) and not rehome()["running"], 15), rehome()
    assert rehome()["failures"] == 0
    a.stop(signal.SIGKILL)
    with b.client() as cb:
        for oid in mine:
            with cb.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(64_000, oid))


def test_a_lost_replica_is_made_again_on_the_remaining_nodes(daemon_factory, etcd):
    """Two replicas over three nodes, objects put on C; C dies: objects that had C as a home
    get their new home (the other survivor) from the survivor that holds them, in both
    directions. Then B dies too and A still has every object."""
    nodes = {name: etcd_node(daemon_factory, etcd, name, replicas=2, prefix="/replica/") for name in "abc"}
    assert all(wait_for(lambda d=d: members(d) == set("abc"), 15) for d in nodes.values())
    ids = [ObjectId(f"rep-{i}".encode().ljust(32, b".")) for i in range(30)]
    with nodes["c"].client() as cc:  # C (soon dead) put them: each went to its two homes
        for oid in ids:
            cc.put(oid, payload(64_000, oid))

    def on_homes(names):
        return all(all(local_tiers(nodes[n], [oid]) == ("host",) for n in home_nodes(oid, names, 2)) for oid in ids)

    assert wait_for(lambda: on_homes("abc"), 15)
    nodes["c"].stop(signal.SIGKILL)
    assert wait_for(lambda: members(nodes["a"]) == {"a", "b"} == members(nodes["b"]), 15)
    assert wait_for(lambda: on_homes("ab"), 15)  # both survivors hold every object

    def sent():
        counts = {}
        for name in "ab":
            with nodes[name].client() as c:
                counts[name] = c.stats()["tiers"]["remote"]["rehome"]["objects_sent"]
        return counts
    # (a, c)-homed objects went from A to B, (b, c)-homed ones from B to A.
    expect = {n: sum(set(home_nodes(oid, "abc", 2)) == {n, "c"} for oid in ids) for n in "ab"}
    assert wait_for(lambda: sent() == expect, 15), (sent(), expect)
    nodes["b"].stop(signal.SIGKILL)
    with nodes["a"].client() as ca:
        for oid in ids:
            with ca.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(64_000, oid))
        ca.check_integrity()


def test_a_clean_stop_hands_over_what_the_node_was_home_to(daemon_factory, etcd):
    a = etcd_node(daemon_factory, etcd, "a", prefix="/handover/")
    b = etcd_node(daemon_factory, etcd, "b", prefix="/handover/")
    assert wait_for(lambda: members(a) == {"a", "b"} == members(b), 15)
    on_b = ids_homed("ho", "ab", ("b",), 8)
    with b.client() as cb:
        for oid in on_b:
            cb.put(oid, payload(100_000, oid))
    assert local_tiers(a, on_b) == ("remote",) * 8  # only B, their home, has them
    assert b.stop(signal.SIGTERM) == 0
    with a.client() as ca:
        assert ca.lookup(on_b).tiers == ("host",) * 8  # handed over before B left
        for oid in on_b:
            with ca.get(oid) as lease:
                assert np.array_equal(lease.numpy(), payload(100_000, oid))
