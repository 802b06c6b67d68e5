"""server.tiering.shared_index: the daemon's side of the shared index. Every object that enters
the host index is published; every way out (evict, expire, delete, drop, replace) clears the
record before the extent can be reused; a full window publishes nothing; clients can only read."""

from __future__ import annotations

import asyncio
import mmap

import pytest

from kvstore.config import HostTierConfig
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.shared_index import OCCUPIED, PROBE_SLOTS, RECORD, descriptor_digest, home_slot, record_at
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager
from kvstore.server.tiering.shared_index import SharedIndex

DESC = StateDescriptor("ns", "m", "r")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def oid(i: int) -> ObjectId:
    return ObjectId(i.to_bytes(32, "little"))


def records(shared: SharedIndex) -> dict:
    """digest -> (seq, offset, size, checksum, descriptor digest, expires_at) of every record, read
    through a fresh read-only mapping of the fd, as a client maps it."""
    found = {}
    with mmap.mmap(shared.fd, shared.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as table:
        for slot in range(shared.slots):
            seq, digest, offset, size, checksum, desc, expires_at, flags = RECORD.unpack_from(table, record_at(slot))
            assert seq % 2 == 0
            if flags == OCCUPIED:
                found[digest] = (seq, offset, size, checksum, desc, expires_at)
    return found


async def _filled(count: int, clock: Clock, ttl_every: int = 0):
    manager = TierManager(compose(HostTierConfig(arena_bytes=64 * 4096, prefault=False), clock=clock))
    ns = await manager.host.open_namespace("ns")
    for i in range(count):
        hints = Hints(ttl_s=5.0) if ttl_every and i % ttl_every == 0 else Hints()
        manager.host.publish(ns, oid(i), manager.host.alloc_now(ns, 4096), 4096, bytes([i]) * 16, DESC, hints)
    return manager, ns


def test_every_indexed_object_is_published_as_it_is():
    manager, ns = asyncio.run(_filled(10, Clock(), ttl_every=3))
    got = records(ns.shared)
    assert len(got) == 10
    for i in range(10):
        entry = ns.objects[oid(i)]
        seq, offset, size, checksum, desc, expires_at = got[oid(i).digest]
        assert (offset, size, checksum) == (entry.extent.offset, 4096, bytes([i]) * 16)
        assert desc == descriptor_digest(DESC) and expires_at == entry.expires_at and seq >= 2
    manager.check_integrity()
    manager.close()


def test_every_way_out_of_the_index_clears_the_record_before_the_extent_is_reused():
    clock = Clock()
    manager, ns = asyncio.run(_filled(64, clock, ttl_every=8))  # the arena is full
    # a put into the full arena evicts; the victim's record goes before its extent is handed out
    extent = manager.host.alloc_now(ns, 4096)
    evicted = {oid(i).digest for i in range(64)} - {e.digest for e in ns.objects}
    assert len(evicted) == 1 and not evicted & set(records(ns.shared))
    manager.host.publish(ns, oid(100), extent, 4096, b"n" * 16, DESC, Hints())
    assert manager.index.delete("ns", [oid(1)], scope="node") == 1
    manager.host.drop(ns, ns.objects[oid(2)])
    clock.now += 10  # past the TTL of every eighth object
    manager.expire()
    gone = {oid(1).digest, oid(2).digest} | {oid(i).digest for i in range(0, 64, 8)}
    got = records(ns.shared)
    assert set(got) == {e.digest for e in ns.objects} and not (gone | evicted) & set(got)
    assert got[oid(100).digest][1] == extent.offset
    assert ns.counters.num_evictions == 1 and ns.counters.num_expired == len(gone - evicted) - 2
    manager.check_integrity()
    manager.close()


def test_a_replaced_expired_copy_is_republished_at_its_new_extent():
    clock = Clock()
    manager, ns = asyncio.run(_filled(1, clock, ttl_every=1))
    old_offset = ns.objects[oid(0)].offset  # (the old entry's row is the new one's after the publish)
    clock.now += 10
    new_extent = manager.host.alloc_now(ns, 4096)
    manager.host.publish(ns, oid(0), new_extent, 4096, b"x" * 16, DESC, Hints())
    got = records(ns.shared)
    assert list(got) == [oid(0).digest] and got[oid(0).digest][1] == new_extent.offset != old_offset
    manager.check_integrity()
    manager.close()


def test_ids_whose_slots_are_all_taken_are_not_published():
    shared = SharedIndex("t", 4096 * 1024)
    manager, ns = asyncio.run(_filled(0, Clock()))
    home = home_slot(oid(0).digest, shared.slots)
    same_home = [i for i in range(200_000) if home_slot(oid(i).digest, shared.slots) == home][:PROBE_SLOTS + 1]
    entries = []
    for i in same_home:
        manager.host.publish(ns, oid(i), manager.host.alloc_now(ns, 4096), 4096, b"c" * 16, DESC, Hints())
        entries.append(ns.objects[oid(i)])
    published = [shared.publish(e) for e in entries]
    assert published == [True] * PROBE_SLOTS + [False] and shared.num_unpublished == 1
    shared.remove(entries[3])
    assert shared.publish(entries[-1]) and shared.num_published == PROBE_SLOTS
    shared.close()
    manager.close()


def test_clients_cannot_map_the_index_writable():
    shared = SharedIndex("t", 1 << 20)
    with pytest.raises(PermissionError):
        mmap.mmap(shared.fd, shared.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    shared.close()


def test_off_the_namespace_has_no_index():
    async def go():
        manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False, shared_index=False)))
        ns = await manager.host.open_namespace("ns")
        manager.host.publish(ns, oid(0), manager.host.alloc_now(ns, 4096), 4096, b"c" * 16, DESC, Hints())
        return manager, ns
    manager, ns = asyncio.run(go())
    assert not ns.shared.enabled and ns.shared.fd == -1
    manager.check_integrity()
    manager.close()


def test_a_batch_is_published_as_each_entry_would_be_and_full_windows_are_counted():
    """HostTier.publish_many: every record as publish writes it (even seq, the entry's extent,
    size, checksum, descriptor); ids whose windows are full are left out and counted, the
    others of the batch take the free slots of theirs."""
    manager, ns = asyncio.run(_filled(0, Clock()))
    shared = ns.shared
    home = home_slot(oid(0).digest, shared.slots)
    same_home = [i for i in range(200_000) if home_slot(oid(i).digest, shared.slots) == home][:PROBE_SLOTS + 2]
    ids = [oid(i) for i in same_home] + [oid(i) for i in range(300_000, 300_030)]
    extents = [manager.host.alloc_now(ns, 4096) for _ in ids]
    checksums = [bytes([k]) * 16 for k in range(len(ids))]
    entries = manager.host.publish_many(ns, ids, extents, [4096] * len(ids), b"".join(checksums), DESC, Hints())
    got = records(shared)
    assert shared.num_unpublished == 2 and shared.num_published == len(ids) - 2 == len(got)
    assert set(got) == {o.digest for o in ids} - {oid(i).digest for i in same_home[PROBE_SLOTS:]}
    for o, extent, checksum, entry in zip(ids, extents, checksums, entries):
        assert entry == ns.objects[o] and entry.extent == extent and entry.checksum == checksum
        if o.digest in got:
            seq, offset, size, sum_, desc, expires_at = got[o.digest]
            assert (seq, offset, size, sum_, desc) == (2, extent.offset, 4096, checksum, descriptor_digest(DESC))
            assert expires_at == entry.expires_at == float("inf")
    assert ns.counters.num_puts == len(ids) and ns.counters.bytes_in == 4096 * len(ids)
    manager.check_integrity()
    manager.close()


def test_a_touch_counts_each_hit_on_the_object_it_names_once_per_mention():
    """count_shared_hits (op touch): ids probed as one batch; each mention of an id still
    here is a hit on its entry and an access for the policy; ids gone are counted as hits
    but touch nothing."""
    manager, ns = asyncio.run(_filled(6, Clock()))
    accessed = []
    on_access = ns.policy.on_access
    ns.policy.on_access = lambda row: (accessed.append(row), on_access(row))
    ids = tuple(o.digest for o in (oid(1), oid(4), oid(1), oid(99), oid(5), oid(1)))
    manager.touch("ns", ids)
    assert [ns.objects[oid(i)].num_hits for i in range(6)] == [0, 3, 0, 0, 1, 1]
    assert sorted(accessed) == sorted(ns.objects[oid(i)].row for i in (1, 1, 1, 4, 5))
    counters = ns.counters
    assert (counters.num_gets, counters.num_hits, counters.num_shared_hits) == (6, 6, 6)
    assert counters.bytes_out == 5 * 4096
    manager.touch("absent", ids)  # a namespace not open here: nothing to count
    manager.check_integrity()
    manager.close()
