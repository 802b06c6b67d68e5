"""Interleavings forced at the NVMe tier's race windows, in process: the real tier manager,
host tier, NVMe tier (RocksDB and O_DIRECT files in a temporary directory) and mover, with
gates at the windows (server/windows.py's points) that a test holds shut while it does
something else, then opens. Each test makes one interleaving that the daemon-level race tests
(test_nvme_races.py) and the history checker (tests/checker/) make only by chance."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import xxhash

from kvstore.config import HostTierConfig, NvmeTierConfig
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.messages import Get
from kvstore.server.later import is_ready, resolve
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager
from kvstore.server.tiering.nvme_held import NvmeHeld
from kvstore.server.tiering.nvme_mover import TierMover

MiB = 1 << 20
NS = "t"
OWNER = 1


class Gates:
    """The race windows as gates: `shut(point)` makes the next pass through it wait until
    `open(point)`; `reached(point)` is set once something waits there."""

    def __init__(self):
        self._open: dict[str, asyncio.Event] = {}
        self.reached: dict[str, asyncio.Event] = {}

    def shut(self, point: str) -> None:
        self._open[point], self.reached[point] = asyncio.Event(), asyncio.Event()

    def open(self, point: str) -> None:
        self._open.pop(point).set()

    async def at(self, point: str) -> None:
        gate = self._open.get(point)
        if gate is not None:
            self.reached[point].set()
            await gate.wait()


async def chain(tmp_path, gates: Gates, write_policy: str = "write_back") -> TierManager:
    config = NvmeTierConfig(enabled=True, path=str(tmp_path / "nvme"), capacity_bytes=64 * MiB,
                            file_bytes=64 * MiB, write_policy=write_policy, admit_min_hits=0)
    mover = None

    def make_nvme(host, events, sends, departures, held):
        nonlocal mover
        mover = TierMover(host, events, sends, departures, held, config, gates)
        return mover
    manager = TierManager(compose(HostTierConfig(arena_bytes=8 * MiB, prefault=False),
                                  make_holdings=lambda: NvmeHeld(config.capacity_bytes), make_nvme=make_nvme))
    await mover.open()
    return manager


async def put_on_nvme_only(manager: TierManager, oid: ObjectId, data: np.ndarray):
    """An object written down to NVMe and evicted from the host arena (as a demotion leaves it)."""
    host = manager.host
    ns = await host.open_namespace(NS)
    extent = await host.allocate(ns, data.size, manager.chain.sink)
    host.namespaces[NS].arena.view(extent)[:data.size] = data
    entry = host.publish(ns, oid, extent, data.size, xxhash.xxh3_128_digest(data), StateDescriptor(NS, "m", "r"),
                         Hints())
    assert await manager.nvme.write(entry) == "sync"
    ns.policy.on_remove(entry.row)  # as victims() does before an eviction
    host.evict(ns, entry)
    assert manager.nvme.holds(NS, oid) and oid not in ns.objects


def test_a_delete_whose_host_part_runs_while_a_promotion_reads_leaves_nothing(tmp_path):
    """Before the fix NVMe forgot its copy in a task of its own, a step after the host's
    delete: a promotion that published in between put the object back in host memory, and
    from there (written down again) on NVMe."""
    async def run():
        gates = Gates()
        manager = await chain(tmp_path, gates)
        oid, data = ObjectId(b"p" * 32), np.arange(MiB, dtype=np.uint8)
        await put_on_nvme_only(manager, oid, data)
        gates.shut("nvme_read")
        reading = asyncio.ensure_future(resolve(manager.get(OWNER, Get(NS, oid))))
        await gates.reached["nvme_read"].wait()  # read, not yet published
        deleting = manager.index.here.delete_here(NS, [oid])  # the request's own step: host, then NVMe
        gates.open("nvme_read")
        got = await reading  # the promotion goes on before the delete's awaitable is awaited
        if got.hit:
            manager.release(OWNER, got.lease)
        assert await resolve(deleting) == [True]
        ns = manager.host.namespaces[NS]
        assert oid not in ns.objects, "the promotion put a deleted object back in host memory"
        assert not manager.nvme.holds(NS, oid)
        manager.check_integrity()
        await manager.nvme.close()
    asyncio.run(run())


def test_a_delete_during_a_demotion_write_removes_the_copy_written(tmp_path):
    """The entry is deleted while its bytes are on their way to NVMe: the copy made must
    not outlive it (after a restart it would be the deleted object again)."""
    async def run():
        gates = Gates()
        manager = await chain(tmp_path, gates)
        host = manager.host
        ns = await host.open_namespace(NS)
        oid, data = ObjectId(b"d" * 32), np.arange(MiB, dtype=np.uint8)
        extent = await host.allocate(ns, data.size, manager.chain.sink)
        ns.arena.view(extent)[:data.size] = data
        entry = host.publish(ns, oid, extent, data.size, xxhash.xxh3_128_digest(data),
                             StateDescriptor(NS, "m", "r"), Hints())
        gates.shut("nvme_write")
        writing = asyncio.ensure_future(manager.nvme.write(entry))
        await gates.reached["nvme_write"].wait()
        gates.open("nvme_write")
        gates.shut("nvme_write")  # the second pass: after the NVMe put, before the copy is recorded
        await gates.reached["nvme_write"].wait()
        deleting = manager.index.here.delete_here(NS, [oid])
        gates.open("nvme_write")
        assert await writing is None
        assert await resolve(deleting) == [True]
        assert not manager.nvme.holds(NS, oid) and oid not in ns.objects
        assert manager.nvme.nvme.meta(NS, oid) is None, "the deleted object's record stayed on NVMe"
        manager.check_integrity()
        await manager.nvme.close()
    asyncio.run(run())


def test_a_delete_acknowledged_while_another_delete_removes_the_record_waits_for_it(tmp_path):
    """Two deletes of one NVMe object: the second found nothing to forget and answered at
    once, before the first had removed the record; a SIGKILL then brought the object back."""
    async def run():
        gates = Gates()
        manager = await chain(tmp_path, gates)
        oid, data = ObjectId(b"r" * 32), np.arange(MiB, dtype=np.uint8)
        await put_on_nvme_only(manager, oid, data)
        gates.shut("nvme_delete")
        first = asyncio.ensure_future(resolve(manager.index.here.delete_here(NS, [oid])))
        await gates.reached["nvme_delete"].wait()  # forgotten; its record not removed yet
        second = manager.index.here.delete_here(NS, [oid])
        assert not is_ready(second), "the second delete answered before the record was removed"
        gates.open("nvme_delete")
        assert await first == [True] and await resolve(second) == [False]
        assert manager.nvme.nvme.meta(NS, oid) is None
        await manager.nvme.close()
    asyncio.run(run())


def test_a_delete_acknowledged_before_another_deletes_removal_began_removes_the_record(tmp_path):
    """The first delete's record removal began only once its caller awaited it (a cluster's
    delete awaits its peers first): a second delete found nothing left to forget and nothing
    in its turn, answered at once, and a SIGKILL then brought the object back (the checker's
    write_through run, six reads)."""
    async def run():
        manager = await chain(tmp_path, Gates())
        oid, data = ObjectId(b"s" * 32), np.arange(MiB, dtype=np.uint8)
        await put_on_nvme_only(manager, oid, data)
        first = manager.index.here.delete_here(NS, [oid])  # forgotten; not awaited yet
        second = manager.index.here.delete_here(NS, [oid])
        assert not is_ready(second), "the second delete answered while the record was still there"
        assert await resolve(second) == [False]
        assert manager.nvme.nvme.meta(NS, oid) is None, "acknowledged, and the record is still there"
        assert await resolve(first) == [True]
        await manager.nvme.close()
    asyncio.run(run())


def test_a_delete_under_way_when_the_tier_closes_removes_its_record_first(tmp_path):
    """A SIGTERM while a delete waits: the tier closed under the removal (an AttributeError
    in the daemon's log, the record left for the next start to bring back)."""
    async def run():
        manager = await chain(tmp_path, Gates())
        oid, data = ObjectId(b"c" * 32), np.arange(MiB, dtype=np.uint8)
        await put_on_nvme_only(manager, oid, data)
        deleting = manager.index.here.delete_here(NS, [oid])
        await manager.nvme.close()
        assert await resolve(deleting) == [True]
        again = await chain(tmp_path, Gates())
        assert not again.nvme.holds(NS, oid)
        await again.nvme.close()
    asyncio.run(run())


def test_a_write_never_takes_an_expired_copy_for_its_own(tmp_path):
    """A copy past its TTL stays in NVMe's table until housekeeping deletes it (each second).
    Before the fix a new put of the id in that time was answered durable without a write
    ("NVMe holds it"), and lost when housekeeping deleted the old copy."""
    async def run():
        manager = await chain(tmp_path, Gates(), write_policy="write_through")
        host, mover = manager.host, manager.nvme
        ns = await host.open_namespace(NS)
        oid = ObjectId(b"e" * 32)
        desc = StateDescriptor(NS, "m", "r")

        async def put(data, hints):
            extent = await host.allocate(ns, data.size, manager.chain.sink)
            ns.arena.view(extent)[:data.size] = data
            entry = host.publish(ns, oid, extent, data.size, xxhash.xxh3_128_digest(data), desc, hints)
            return entry, await mover.write(entry)
        old, _ = await put(np.zeros(MiB, np.uint8), Hints(ttl_s=0.05))
        await asyncio.sleep(0.1)  # past the TTL, before housekeeping's expire_due
        assert not mover.holds(NS, oid)
        host.expire(ns, old)
        new_data = np.ones(MiB, np.uint8)
        new, durability = await put(new_data, Hints())
        assert durability == "sync" and new.on_nvme
        mover.expire_due()  # housekeeping: the old copy's deadline
        await asyncio.sleep(0.05)
        assert mover.holds(NS, oid), "the new object's NVMe copy went with the expired one's"
        out = np.empty(MiB, np.uint8)
        assert mover.nvme.get_into(NS, oid, out) == MiB and (out == 1).all()
        await mover.close()
    asyncio.run(run())


def test_a_copy_written_down_later_keeps_the_ttl_of_its_put(tmp_path):
    """Before the fix an NVMe record's created_at was the time of the write, not of the put:
    an object demoted half-way through its TTL and promoted back lived half a TTL too long
    (and a restart counted its deadline from the write too)."""
    async def run():
        manager = await chain(tmp_path, Gates())
        host, mover = manager.host, manager.nvme
        ns = await host.open_namespace(NS)
        oid, data = ObjectId(b"t" * 32), np.arange(MiB, dtype=np.uint8)
        extent = await host.allocate(ns, data.size, manager.chain.sink)
        ns.arena.view(extent)[:data.size] = data
        entry = host.publish(ns, oid, extent, data.size, xxhash.xxh3_128_digest(data),
                             StateDescriptor(NS, "m", "r"), Hints(ttl_s=0.6))
        await asyncio.sleep(0.3)
        assert await mover.write(entry) == "sync"  # demoted half-way through its TTL
        ns.policy.on_remove(entry.row)
        host.evict(ns, entry)
        assert mover.nvme.meta(NS, oid).created_at == pytest.approx(entry.created_at, abs=0.01)
        got = await resolve(manager.get(OWNER, Get(NS, oid)))  # promoted back
        assert got.hit
        manager.release(OWNER, got.lease)
        await asyncio.sleep(0.4)  # 0.7 s after the put
        assert not (await resolve(manager.get(OWNER, Get(NS, oid)))).hit, "read past its TTL"
        await mover.close()
    asyncio.run(run())


@pytest.mark.parametrize("count", [3, 40])  # one by one, and probed together (16 and more)
def test_a_delete_reports_and_removes_exactly_what_nvme_held(tmp_path, count):
    async def run():
        manager = await chain(tmp_path, Gates())
        held = [ObjectId(bytes([i, 7]) * 16) for i in range(count)]
        for oid in held[::2]:
            await put_on_nvme_only(manager, oid, np.full(4096, 3, np.uint8))
        found = await resolve(manager.index.here.delete_here(NS, held))
        assert found == [i % 2 == 0 for i in range(count)]
        assert not any(manager.nvme.holds(NS, oid) or manager.nvme.nvme.meta(NS, oid) for oid in held)
        manager.check_integrity()
        await manager.nvme.close()
    asyncio.run(run())


def test_a_read_never_joins_a_promotion_of_a_deleted_copy(tmp_path):
    """Concurrent gets of one NVMe object share its promotion. One whose copy was deleted
    while it read brings nothing; a get of the id's next copy (put, written down and evicted
    meanwhile) joined it all the same and answered a miss for an object NVMe held. Found
    by the history checker's soak (a "lost" read)."""
    async def run():
        gates = Gates()
        manager = await chain(tmp_path, gates)
        oid = ObjectId(b"j" * 32)
        await put_on_nvme_only(manager, oid, np.zeros(MiB, np.uint8))
        gates.shut("nvme_read")
        stale = asyncio.ensure_future(resolve(manager.get(OWNER, Get(NS, oid))))
        await gates.reached["nvme_read"].wait()  # the old copy read, not yet published
        assert await resolve(manager.index.here.delete_here(NS, [oid])) == [True]
        await put_on_nvme_only(manager, oid, np.ones(MiB, np.uint8))  # the next copy, on NVMe only
        fresh = asyncio.ensure_future(resolve(manager.get(OWNER, Get(NS, oid))))
        await asyncio.sleep(0.01)
        gates.open("nvme_read")
        assert not (await stale).hit
        got = await fresh
        assert got.hit, "a get of an object NVMe holds answered a miss"
        ns = manager.host.namespaces[NS]
        assert (np.frombuffer(ns.arena.view(ns.objects[oid].extent)[:MiB], np.uint8) == 1).all()  # the new copy
        manager.release(OWNER, got.lease)
        manager.check_integrity()
        await manager.nvme.close()
    asyncio.run(run())
