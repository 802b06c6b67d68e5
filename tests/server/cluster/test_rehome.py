"""The re-homer's planning and scheduling, in process: a real tier manager holding real
objects, and a stand-in for the remote tier (peers that answer from dicts, or are down).
tests/server/cluster/test_cluster_tiers.py runs it between real daemons; this file pins down what is
hard to provoke there: a membership flap, a target that is down during the pass and comes
back, one object whose send raises."""

import asyncio
import contextlib
import types


import kvstore.server.cluster.rehome as rehome
from kvstore.config import ClusterConfig, HostTierConfig
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.ownership import home_nodes
from kvstore.server.cluster.replicate import Replicator
from kvstore.server.cluster.rehome import Rehomer
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager


class StandInRemote:
    """What the re-homer asks of tiers.remote.RemoteTier, answered from dicts."""

    def __init__(self, node_id, members):
        self.node_id, self._members = node_id, dict(members)
        self.stored: dict[str, set] = {}  # node -> keys it holds
        self.down: set[str] = set()
        self.explode: set[bytes] = set()  # digests whose send raises

    def members(self):
        return dict(self._members)

    async def held_on(self, node, namespace, ids):
        await asyncio.sleep(0)
        if node in self.down:
            return None
        return [(namespace, oid.digest) in self.stored.get(node, set()) for oid in ids]

    async def put_to(self, node, namespace, oid, meta, buffer):
        await asyncio.sleep(0)
        if oid.digest in self.explode:
            raise RuntimeError("a disk error while reading this one")
        if node in self.down:
            return False
        assert len(bytes(buffer)) == meta.size
        self.stored.setdefault(node, set()).add((namespace, oid.digest))
        return True


class StandInLink:
    """server.cluster.link.ClusterLink's parts the re-homer uses (its real serving and replicating
    roles), bound to the stand-in remote."""

    def __init__(self, local, remote):
        self.remote = remote
        node = types.SimpleNamespace(remote=remote, node_id=remote.node_id)
        self.sending = Replicator(local.host, local.events, ClusterConfig(), node, set()).sending


def objects(n):
    return [ObjectId(f"rh-{i}".encode().ljust(32, b".")) for i in range(n)]


@contextlib.asynccontextmanager
async def rehomer_holding(ids, members, delay_s=0.01):
    manager = TierManager(compose(HostTierConfig(arena_bytes=4 << 20, prefault=False)))
    ns = await manager.host.open_namespace("t")
    for oid in ids:
        extent = await manager.host.allocate(ns, 1000, manager.chain.sink)
        manager.host.publish(ns, oid, extent, 1000, b"\0" * 16, StateDescriptor("t", "m", "r"), Hints())
    remote = StandInRemote("a", {n: f"{n}:1" for n in members})
    local = manager.chain.local
    r = Rehomer(StandInLink(local, remote), local, ClusterConfig(rehome_delay_s=delay_s))
    r.begin(members)
    try:
        yield r, remote, manager
    finally:
        r.stop()
        manager.check_integrity()  # every hold given back
        manager.close()


async def settle(r, remote, want, limit_s=10.0):
    """Let passes run until `want()` holds (a liveness bound, not a measurement)."""
    async with asyncio.timeout(limit_s):
        while not (want() and not r.stats()["running"]):
            await asyncio.sleep(0.01)


def homed_on(ids, node, members):
    return {("t", oid.digest) for oid in ids if home_nodes(oid, members) == [node]}


def test_a_flap_away_and_back_still_rehomes_what_was_put_meanwhile():
    """Members a,b -> a -> a,b before any pass ran: objects put while b was away (held only
    here) must reach b, though the list is the same as at the start."""
    ids = objects(40)

    async def scenario():
        async with rehomer_holding(ids, "ab", delay_s=0.05) as (r, remote, _):
            r.on_members({"a": "a:1"})
            r.on_members({"a": "a:1", "b": "b:1"})
            want = homed_on(ids, "b", "ab")
            await settle(r, remote, lambda: remote.stored.get("b", set()) == want)
            return r.stats(), len(want)
    stats, n = asyncio.run(scenario())
    assert n > 5 and stats["objects_sent"] == n and stats["failures"] == 0


def test_a_target_down_during_the_pass_is_retried_until_it_has_its_share(monkeypatch):
    monkeypatch.setattr(rehome, "RETRY_FIRST_S", 0.05)
    ids = objects(30)

    async def scenario():
        async with rehomer_holding(ids, "a") as (r, remote, _):
            remote._members["b"] = "b:1"
            remote.down.add("b")
            r.on_members(remote.members())
            await settle(r, remote, lambda: r.stats()["pending_retries"] > 0)
            failed = r.stats()["failures"]
            remote.down.clear()  # b answers again: the retry delivers
            want = homed_on(ids, "b", "ab")
            await settle(r, remote, lambda: remote.stored.get("b", set()) == want)
            return failed, r.stats()
    failed, stats = asyncio.run(scenario())
    assert failed >= 1 and stats["pending_retries"] == 0 and stats["passes"] >= 2


def test_one_objects_error_does_not_end_the_pass(monkeypatch):
    monkeypatch.setattr(rehome, "RETRY_FIRST_S", 3600)  # no retry within the test
    ids = objects(30)

    async def scenario():
        async with rehomer_holding(ids, "a") as (r, remote, _):
            remote._members["b"] = "b:1"
            want = homed_on(ids, "b", "ab")
            bad = sorted(want)[0]
            remote.explode.add(bad[1])
            r.on_members(remote.members())
            await settle(r, remote, lambda: remote.stored.get("b", set()) == want - {bad})
            return r.stats(), len(want)
    stats, n = asyncio.run(scenario())
    assert stats["objects_sent"] == n - 1 and stats["failures"] == 1 and stats["pending_retries"] == 1
