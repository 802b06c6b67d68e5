"""The tier manager's demotion to peers, in process: the real manager, arena and policy,
with a stand-in for the cluster link (the network is what it replaces; tests/server/
test_cluster_tiers.py runs the real one). Shown: victims are sent before they leave; a send
that is cancelled (a peer's deadline) or fails leaves every victim resident and tracked, so
the index, policy and arena still agree; a victim read during the send stays."""

import asyncio

import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import CapacityError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager

MiB = 1 << 20


class StandInLink:
    """What TierManager asks of server.cluster.link.ClusterLink when it makes room, and of its
    sending side (server.cluster.replicate.Replicator): both sides of the remote tier in one.
    `held`: the chain's set of the objects the homes are known to hold."""

    remote = object()  # "clustered"

    def __init__(self, behaviour, held):
        self.behaviour, self.held, self.sent = behaviour, held, []

    def victim_sink(self, host):  # as ClusterLink's: copy home, then evict
        return host.copy_then_evict(self.demote)

    def must_send(self, namespace, object_id) -> bool:
        return True

    async def demote(self, entries) -> None:
        await self.behaviour(self, entries)


def manager_with(behaviour, objects=6):
    manager = TierManager(compose(HostTierConfig(arena_bytes=8 * MiB, prefault=False),
                                  make_sends=lambda host, events, held: StandInLink(behaviour, held),
                                  make_remote=lambda local, link: link))

    async def fill():
        ns = await manager.host.open_namespace("t")
        for i in range(objects):
            oid = ObjectId(bytes([i]) * 32)
            extent = await manager.host.allocate(ns, MiB, manager.chain.sink)
            manager.host.publish(ns, oid, extent, MiB, b"\0" * 16, StateDescriptor("t", "m", "r"), Hints())
        return ns
    return manager, fill


def test_victims_are_sent_then_evicted():
    async def send(link, entries):
        await asyncio.sleep(0)
        link.sent += [e.object_id for e in entries]
        link.held.update((e.namespace, e.object_id.digest) for e in entries)  # every home holds them

    manager, fill = manager_with(send)

    async def scenario():
        ns = await fill()
        extent = await manager.host.allocate(ns, 4 * MiB, manager.chain.sink)  # the arena holds 8: some of the six must go
        ns.arena.free(extent)
        return ns
    ns = asyncio.run(scenario())
    assert len(manager.remote.sent) >= 2
    assert all(oid not in ns.objects for oid in manager.remote.sent)  # sent, then gone
    assert not manager.remote.held  # each left this node: the homes' holding of it is forgotten
    manager.check_integrity()


@pytest.mark.parametrize("failure", ["cancelled", "error"])
def test_an_interrupted_send_leaves_every_victim_resident_and_tracked(failure):
    async def stall(link, entries):
        if failure == "error":
            raise RuntimeError("the link broke")
        await asyncio.sleep(3600)

    manager, fill = manager_with(stall)

    async def scenario():
        ns = await fill()
        task = asyncio.ensure_future(manager.host.allocate(ns, 4 * MiB, manager.chain.sink))
        if failure == "cancelled":
            await asyncio.sleep(0.05)
            task.cancel()
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await task
        return ns
    ns = asyncio.run(scenario())
    assert len(ns.objects) == 6  # nothing left the node unsent
    manager.check_integrity()  # and the policy tracks every one of them again


def test_a_victim_read_during_the_send_stays():
    async def send(link, entries):
        link.read = entries[0]
        manager.host.hold(entries[0])  # a reader arrives while the copy is in flight
        await asyncio.sleep(0)

    manager, fill = manager_with(send)

    async def scenario():
        ns = await fill()
        try:
            await manager.host.allocate(ns, 8 * MiB, manager.chain.sink)
        except CapacityError:
            pass  # the read victim holds one MiB: the whole arena cannot be freed
        return ns
    ns = asyncio.run(scenario())
    assert ns.objects.get(manager.remote.read.object_id) == manager.remote.read
    manager.host.release_hold(manager.remote.read)
    manager.check_integrity()
