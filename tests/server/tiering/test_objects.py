"""server.tiering.objects: the one way an entry is made and the one liveness rule (issue 14, item 2)."""

import asyncio
import math

import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import Conflict
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.messages import Get
from kvstore.server.tiering.objects import check_same_object, lone_entry

OID = ObjectId(bytes(32))
DESC = StateDescriptor("ns", "m", "r")


def entry(hints, now=100.0, **kwargs):
    return lone_entry(OID, "ns", None, 10, b"c" * 16, DESC, hints, now, **kwargs)


def test_a_ttl_counts_from_now_and_ends_liveness_exactly_there():
    e = entry(Hints(ttl_s=5.0))
    assert e.expires_at == 105.0
    assert e.is_live(104.999) and not e.is_live(105.0)


def test_without_a_ttl_an_entry_lives_and_is_unpinned_unless_asked():
    e = entry(Hints())
    assert e.expires_at == math.inf and e.is_live(1e12)
    assert e.pinned_until == 0.0 and not e.is_pinned(0.0)
    assert entry(Hints(), pin=True).is_pinned(1e12)


def test_created_at_is_the_wall_clock_unless_carried_over():
    assert entry(Hints(), created_at=42.0).created_at == 42.0
    assert entry(Hints()).created_at > 1e9  # time.time(), not the monotonic `now`


def test_an_id_is_one_state():
    check_same_object(OID, 10, DESC, 10, DESC)
    with pytest.raises(Conflict, match="10 bytes, not 11"):
        check_same_object(OID, 10, DESC, 11, DESC)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def _manager_with_expired_copy():
    from kvstore.config import HostTierConfig
    from kvstore.server.tiering.chain import compose
    from kvstore.server.tiering.manager import TierManager
    clock = Clock()
    manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False), clock=clock))
    ns = await manager.host.open_namespace("ns")
    old = manager.host.publish(ns, OID, await manager.host.allocate(ns, 10, manager.chain.sink), 10, b"c" * 16, DESC, Hints(ttl_s=5.0))
    clock.now += 10  # past its TTL, not yet swept by housekeeping
    return manager, ns, old


def test_a_fetched_or_peer_copy_replaces_an_expired_one_and_is_served():
    """publish used to hand back the expired entry (and free the new bytes): the next read
    then expired it and missed, and a home refused a peer's fresh copy as already held."""
    async def scenario():
        manager, ns, old = await _manager_with_expired_copy()
        new = manager.host.publish(ns, OID, await manager.host.allocate(ns, 10, manager.chain.sink), 10, b"c" * 16, DESC, Hints(ttl_s=5.0))
        assert new != old and new.is_live(manager.clock()) and ns.objects[OID] == new
        assert ns.counters.num_expired == 1
        assert manager.get("reader", Get("ns", OID)).hit
        manager.check_integrity()
    asyncio.run(scenario())


def test_a_copy_still_live_is_kept_and_the_new_bytes_given_back():
    async def scenario():
        manager, ns, old = await _manager_with_expired_copy()
        manager.clock.now -= 10  # back inside the TTL
        used = ns.arena.allocator.used_bytes
        extent = await manager.host.allocate(ns, 10, manager.chain.sink)
        assert manager.host.publish(ns, OID, extent, 10, b"c" * 16, DESC, Hints()) == old
        assert ns.arena.allocator.used_bytes == used and ns.counters.num_expired == 0
    asyncio.run(scenario())


def test_a_home_takes_a_peers_fresh_copy_over_its_expired_one():
    from kvstore.peer_messages import RemoteMeta
    from kvstore.server.cluster.serving import PeerServing

    async def scenario():
        manager, ns, old = await _manager_with_expired_copy()
        serving = PeerServing(manager.chain.local, set(), manager.chain.sink)
        write = await serving.reserve("ns", OID, RemoteMeta(10, b"c" * 16, DESC, Hints()))
        assert write is not None, "the home answered 'held' for a copy past its TTL"
        write.commit()
        assert ns.objects[OID] != old and ns.objects[OID].is_live(manager.clock())
        manager.check_integrity()
    asyncio.run(scenario())


def test_housekeeping_rebuilds_an_index_emptied_by_deletes():
    """Deleting never shrinks the index's columns (nor the policy's dicts): 20,000 deleted
    objects left them allocated until housekeeping moved the rest into smaller ones
    (bench/scale.py measures the memory); the entries still held find their new rows."""

    from kvstore.config import HostTierConfig
    from kvstore.server.tiering.chain import compose
    from kvstore.server.tiering.manager import TierManager

    async def scenario():
        manager = TierManager(compose(HostTierConfig(arena_bytes=(20_000 + 16) * 4096, prefault=False)))
        ns = await manager.host.open_namespace("ns")
        ids = [ObjectId(i.to_bytes(32, "little")) for i in range(20_000)]
        for oid in ids:
            manager.host.publish(ns, oid, await manager.host.allocate(ns, 10, manager.chain.sink), 10, b"c" * 16, DESC, Hints())
        full = ns.objects.nbytes
        kept = ns.objects[ids[-1]]
        manager.index.here.delete_here("ns", ids[:19_000])
        assert ns.objects.nbytes == full  # deleting never shrinks the table
        manager.expire()
        assert ns.objects.nbytes < full / 8 and len(ns.objects) == 1_000
        assert ns.objects.holds(kept) and kept.size == 10 and kept.row == ns.objects[ids[-1]].row
        assert all(ns.objects[oid].object_id == oid for oid in ids[19_000:])
        assert manager.get("reader", Get("ns", ids[-1])).hit
        manager.check_integrity()
    asyncio.run(scenario())


def test_housekeeping_expires_only_what_is_due_and_never_a_newer_copy():
    """The expiry heap (server/tiering/expiry.py): objects without a TTL are never queued; a
    copy past its TTL goes at the next housekeeping; an id put again after its copy expired
    (a new serial) is not dropped by the old copy's queued item."""
    from kvstore.server.tiering.chain import compose
    from kvstore.server.tiering.manager import TierManager
    now = [100.0]
    manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False), clock=lambda: now[0]))

    async def scenario():
        ns = await manager.host.open_namespace("t")
        for i, ttl in enumerate((None, 5.0, 50.0)):
            extent = await manager.host.allocate(ns, 4096, manager.chain.sink)
            manager.host.publish(ns, ObjectId(bytes([i]) * 32), extent, 4096, b"\0" * 16, StateDescriptor("t", "m", "r"),
                            Hints(ttl_s=ttl))
        return ns
    ns = asyncio.run(scenario())
    assert len(manager.host.expiry) == 2  # the object without a TTL is not queued
    now[0] = 106.0
    manager.expire()
    assert set(ns.objects) == {ObjectId(b"\0" * 32), ObjectId(b"\2" * 32)} and ns.counters.num_expired == 1
    now[0] = 151.0  # the 50 s copy is due; first it is found expired by a put of its id, which replaces it
    fresh = manager.host.publish(ns, ObjectId(b"\2" * 32), ns.arena.alloc(4096), 4096, b"\0" * 16,
                            StateDescriptor("t", "m", "r"), Hints())
    manager.expire()  # the old copy's queued item finds a newer copy and leaves it
    assert ns.objects[ObjectId(b"\2" * 32)] == fresh and ns.counters.num_expired == 2
    assert len(manager.host.expiry) == 0
    manager.check_integrity()


def test_the_expiry_heap_sheds_items_of_objects_that_left(monkeypatch):
    import kvstore.server.tiering.expiry as expiry
    monkeypatch.setattr(expiry, "REBUILD_MIN_ITEMS", 4)
    queue = expiry.ExpiryQueue()
    entries = [lone_entry(ObjectId(bytes([i]) * 32), "t", None, 1, b"\0" * 16, StateDescriptor("t", "m", "r"),
                                  Hints(ttl_s=10.0 + i), now=0.0) for i in range(6)]
    for e in entries:
        queue.add(e)
    assert not queue.rebuild_if_stale(entries, 6)  # all live: nothing to shed
    assert queue.rebuild_if_stale(entries[:2], 2) and len(queue) == 2  # four left: rebuilt from the live
    assert [oid for _, oid, _ in queue.due(100.0)] == [entries[0].object_id, entries[1].object_id]


def test_the_packed_record_gives_back_every_unchanging_field_exactly():
    from kvstore.tiers.allocator import Extent
    big = Extent((1 << 40) + 4096, 3 << 20)
    e = lone_entry(OID, "ns", big, (3 << 20) - 5, bytes(range(16)), DESC, Hints(), 1.0,
                           created_at=1764790000.123456)
    assert e.extent == big and e.offset == big.offset and e.size == (3 << 20) - 5
    assert e.checksum == bytes(range(16)) and type(e.checksum) is bytes
    assert e.created_at == 1764790000.123456
    later = lone_entry(OID, "ns", big, 3 << 20, bytes(16), DESC, Hints(), 1.0)
    assert later.serial > e.serial  # each copy its own, never reused
    reply = e.get_reply(7)
    assert (reply.offset, reply.size, reply.checksum) == (big.offset, e.size, e.checksum)
    assert entry(Hints()).extent is None  # made without one (tests, listings)


def test_an_entry_refuses_a_checksum_of_another_length():
    with pytest.raises(ValueError, match="16 bytes"):
        lone_entry(OID, "ns", None, 10, b"c" * 8, DESC, Hints(), 1.0)
