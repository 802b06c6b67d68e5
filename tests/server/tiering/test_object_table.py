"""server/tiering/object_table.py: the host index as columns, its entries as views of rows."""

import math

import numpy as np
import pytest

from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.policy.base import COMPACT_MIN_KEYS
from kvstore.route import Route
from kvstore.config import MAX_WRITE_AFTER_HITS
from kvstore.server.tiering.object_entry import MAX_HITS, StaleEntry
from kvstore.server.tiering.object_table import MIN_ROWS, ObjectTable
from kvstore.tiers.allocator import Extent

DESC = StateDescriptor("t", "m", "r")


def oid(i: int) -> ObjectId:
    return ObjectId(i.to_bytes(8, "little") * 4)


def no_policy(keep) -> None:
    """A table compacted with no eviction policy over its rows."""


def add(table: ObjectTable, i: int, **kwargs):
    """Object i: 100 + i bytes in whole pages (as a pool's fetch lands them below 3.5 KiB)."""
    size = 100 + i
    return table.add(oid(i), Extent(i * 4096, -(-size // 4096) * 4096), size, bytes([i % 256]) * 16, DESC, Hints(),
                     10.0, **kwargs)


def test_every_field_reads_back_as_it_was_added():
    table = ObjectTable("ns")
    e = table.add(oid(1), Extent((1 << 40) + 4096, 3 << 20), (3 << 20) - 5, bytes(range(16)), DESC,
                  Hints(ttl_s=5.0), 100.0, created_at=None, pin=True, on_nvme=True)
    assert e.extent == Extent((1 << 40) + 4096, 3 << 20) and e.size == (3 << 20) - 5
    assert e.checksum == bytes(range(16)) and e.descriptor is DESC and e.hints == Hints(ttl_s=5.0)
    assert e.expires_at == 105.0 and e.pinned_until == math.inf and e.on_nvme and not e.deleted
    assert e.namespace == "ns" and e.object_id == oid(1) and type(e.object_id) is ObjectId
    assert table[oid(1)] == e and oid(1) in table and len(table) == 1
    assert table.get(bytes(oid(1))) == e  # a plain digest finds it too (the shared index's hits)
    e.readers += 2
    e.num_hits += 1
    e.on_nvme = False
    again = table[oid(1)]
    assert (again.readers, again.num_hits, again.on_nvme) == (2, 1, False)


def test_thousands_of_ids_are_found_across_slot_rebuilds_and_removals():
    table = ObjectTable("ns")
    entries = {i: add(table, i) for i in range(5000)}
    for i in range(0, 5000, 3):
        table.remove(entries[i])
        table.release(entries[i])
    table.check_integrity()
    for i in range(5000):
        got = table.get(oid(i))
        assert (got is None) if i % 3 == 0 else (got == entries[i] and got.size == 100 + i)
    assert len(table) == 5000 - len(range(0, 5000, 3))
    assert sorted(int.from_bytes(k[:8], "little") for k in table) == [i for i in range(5000) if i % 3]
    assert table.compact(no_policy) or table._gone <= max(MIN_ROWS, len(table))
    table.check_integrity()


def test_a_batch_is_probed_at_once_as_each_id_would_be_alone():
    """live_rows (a batch's lookup) finds what get finds, past tombstones and other keys'
    probe chains, and leaves out rows past their TTL, for raw digests as for ObjectIds."""
    table = ObjectTable("ns")
    entries = {i: add(table, i) for i in range(3000)}
    for i in range(0, 3000, 4):  # tombstones on the probe chains
        table.remove(entries[i])
        table.release(entries[i])
    for i in range(3000, 3100):  # rows that expire at 15.0
        entries[i] = table.add(oid(i), Extent(i * 4096, 4096), 1, bytes(16), DESC, Hints(ttl_s=5.0), 10.0)
    asked = [oid(i) for i in np.random.default_rng(7).integers(0, 3300, 5000).tolist()]  # misses from 3100 up
    for now, ids in ((12.0, asked), (20.0, [bytes(k) for k in asked])):
        rows = table.live_rows(ids, now).tolist()
        alone = [e.row if (e := table.get(k)) is not None and e.is_live(now) else -1 for k in ids]
        assert rows == alone
        assert any(r >= 0 for r in rows) and any(r < 0 for r in rows)
    assert sum(r >= 0 for r in table.live_rows([oid(i) for i in range(3000, 3100)], 12.0)) == 100
    assert table.live_rows([], 12.0).tolist() == [] and ObjectTable("empty").live_rows(asked, 1.0).max() == -1


def test_a_removed_entry_reads_as_before_until_its_row_is_reused_then_raises():
    table = ObjectTable("ns")
    old = add(table, 1)
    table.remove(old)
    assert not table.holds(old) and table.get(oid(1)) is None
    table.release(old)
    assert old.size == 101  # released, not reused yet: the caller on the same call still reads it
    new = add(table, 2)
    assert new.row == old.row and new.serial != old.serial
    with pytest.raises(StaleEntry, match="another object"):
        old.size
    assert new.size == 102 and table.holds(new) and new != old


def test_a_read_row_cannot_be_released_and_a_removed_one_is_not_found():
    table = ObjectTable("ns")
    e = add(table, 1)
    e.readers = 1
    table.remove(e)
    with pytest.raises(RuntimeError, match="still indexed or read"):
        table.release(e)
    with pytest.raises(RuntimeError, match="not indexed"):
        table.remove(e)
    assert table.total_readers() == 1 and len(table) == 0
    assert table.extents_still_read() == [Extent(4096, 4096)]
    e.readers = 0
    table.release(e)
    assert table.extents_still_read() == []
    table.check_integrity()


def test_emptied_the_table_starts_small_again_and_old_views_raise():
    table = ObjectTable("ns")
    entries = [add(table, i) for i in range(10_000)]
    grown = len(table.c_flags)
    assert grown >= 10_000
    for e in entries:
        table.remove(e)
        table.release(e)
    moves = []
    assert table.compact(moves.append) and len(table.c_flags) == MIN_ROWS < grown and len(table.c_slots) == MIN_ROWS
    assert len(moves) == 1 and len(moves[0]) == 0  # started over: no row kept
    with pytest.raises(StaleEntry):
        entries[-1].size
    table.check_integrity()
    assert add(table, 3).size == 103


def test_adding_an_indexed_id_or_a_bad_checksum_is_refused():
    table = ObjectTable("ns")
    add(table, 1)
    with pytest.raises(RuntimeError, match="indexed already"):
        add(table, 1)
    with pytest.raises(ValueError, match="16 bytes"):
        table.add(oid(2), None, 1, b"x" * 8, DESC, Hints(), 0.0)
    table.check_integrity()


def test_integrity_check_catches_a_lost_slot():
    table = ObjectTable("ns")
    for i in range(20):
        add(table, i)
    table.c_slots[np.nonzero(table.c_slots >= 0)[0][0]] = -1
    with pytest.raises(RuntimeError, match="slots"):
        table.check_integrity()


def test_pinned_and_readers_are_counted_over_the_columns():
    table = ObjectTable("ns")
    add(table, 1, pin=True)
    e = add(table, 2)
    e.pinned_until = 50.0
    add(table, 3).readers = 4
    assert table.num_pinned(40.0) == 2 and table.num_pinned(60.0) == 1 and table.total_readers() == 4
    assert table.idle(e.row, 60.0) and not table.idle(e.row, 40.0)
    e.pinned_until = 0.0  # unpinned: nothing kept for it
    assert table.num_pinned(0.0) == 1 and e.row not in table.pins


def test_a_row_given_to_a_new_object_is_not_pinned_by_the_last_one():
    table = ObjectTable("ns")
    first = add(table, 1, pin=True)
    table.remove(first)
    assert table.num_pinned(0.0) == 0  # removed: not counted though its row keeps its fields
    table.release(first)
    second = add(table, 2)
    assert second.row == first.row and second.pinned_until == 0.0 and table.idle(second.row, 0.0)


def test_compaction_moves_rows_and_views_follow_them_unless_a_removed_row_is_still_read():
    table = ObjectTable("ns")
    entries = [add(table, i) for i in range(20_000)]
    zombie = entries[5]
    zombie.readers = 1
    for e in entries[:19_000]:
        table.remove(e)
        if e is not zombie:
            table.release(e)
    entries[-1].pinned_until = 77.0
    full, rows = table.nbytes, len(table.c_flags)
    moves = []
    table.compact(moves.append)  # (the slots may be rebuilt without tombstones)
    assert not moves and len(table.c_flags) == rows and zombie.size == 105  # a removed row still read: no row moves
    zombie.readers = 0
    table.release(zombie)
    assert table.compact(moves.append) and table.nbytes < full / 8
    assert moves[0].tolist() == [e.row for e in entries[19_000:]] == list(range(19_000, 20_000))
    table.check_integrity()
    held = entries[-1]
    assert table.holds(held) and held.size == 100 + 19_999 and held.row == table[oid(19_999)].row < 1_000
    assert held.pinned_until == 77.0 and table.num_pinned(0.0) == 1 and list(table.pins) == [held.row]
    with pytest.raises(StaleEntry):
        entries[0].size  # left before the compaction: not found by its id



def test_compaction_keeps_each_kept_rows_pin_and_route_and_drops_the_others():
    table = ObjectTable("ns")
    entries = {}
    for i in range(8_000):
        hints = route(i % 256) if i % 10 == 0 else Hints()
        entries[i] = table.add(oid(i), Extent(i * 4096, 4096), 100, bytes(16), DESC, hints, 10.0, pin=i % 7 == 0)
    for i, e in entries.items():
        if i % 5:
            table.remove(e)
            table.release(e)
    assert table.compact(no_policy)
    table.check_integrity()
    kept = {i: table[oid(i)] for i in range(0, 8_000, 5)}
    assert all(e.row < 8_000 // 5 for e in kept.values())  # moved: the rows are new
    assert all(e.pinned_until == (math.inf if i % 7 == 0 else 0.0) for i, e in kept.items())
    assert all(e.hints == (route(i % 256) if i % 10 == 0 else Hints()) for i, e in kept.items())
    assert sorted(table.pins) == sorted(e.row for i, e in kept.items() if i % 7 == 0)
    assert sorted(table.own_hints) == sorted(e.row for i, e in kept.items() if i % 10 == 0)

def route(i: int) -> Hints:
    return Hints(route=Route(block_hashes=[bytes([i]) * 8]))


def test_rows_share_one_descriptor_and_hints_pair_and_a_route_stays_each_rows_own():
    table = ObjectTable("ns")
    other = StateDescriptor("t", "m2", "r")
    shared = [add(table, i) for i in range(100)]
    alone = table.add(oid(500), Extent(0, 64), 10, bytes(16), other, Hints(priority=3), 10.0)
    routed = [table.add(oid(600 + i), Extent(0, 64), 10, bytes(16), DESC, route(i), 10.0) for i in range(3)]
    # DESC with Hints(), other with priority 3, DESC with its rows' own (routed) hints: three pairs
    assert len(table.kinds) == 3 and len(table.own_hints) == 3
    assert all(e.descriptor is DESC and e.hints == Hints() for e in shared)
    assert alone.descriptor is other and alone.hints == Hints(priority=3)
    assert [e.hints for e in routed] == [route(i) for i in range(3)]
    table.check_integrity()
    # A pair stays while a released row still refers to it (its fields read until reused) ...
    table.remove(alone)
    table.release(alone)
    assert len(table.kinds) == 3 and alone.descriptor is other
    # ... and goes when the row is given to another object
    again = add(table, 700)
    assert again.row == alone.row and len(table.kinds) == 2 and again.hints == Hints()
    table.remove(routed[0])
    table.release(routed[0])
    reused = add(table, 701)
    assert reused.row == routed[0].row and reused.row not in table.own_hints and reused.hints == Hints()
    table.check_integrity()


def test_compaction_counts_the_pairs_of_the_rows_it_keeps():
    table = ObjectTable("ns")
    kept = [add(table, i) for i in range(40)]
    gone = [table.add(oid(10_000 + i), Extent(0, 64), 10, bytes(16), StateDescriptor("t", f"m{i % 400}", "r"), Hints(),
                      10.0) for i in range(COMPACT_MIN_KEYS)]
    for e in gone:
        table.remove(e)
        table.release(e)
    assert len(table.kinds) == 401  # released rows keep theirs until reused
    assert table.compact(no_policy)
    table.check_integrity()
    assert len(table.kinds) == 1 and all(table[oid(i)].descriptor is DESC for i in range(40))


def test_the_ttl_column_is_left_untouched_until_an_object_has_a_ttl():
    table = ObjectTable("ns")
    plain = [add(table, i) for i in range(3 * MIN_ROWS)]  # grown twice: copies skip the column
    assert not table.c_expires_at.any() and all(e.expires_at == math.inf and e.is_live(1e18) for e in plain)
    timed = table.add(oid(9999), Extent(0, 64), 10, bytes(16), DESC, Hints(ttl_s=2.0), 10.0)
    assert timed.expires_at == 12.0 and timed.is_live(11.9) and not timed.is_live(12.0)
    rows = table.live_rows([oid(0), oid(9999)], 12.5)
    assert rows[0] == plain[0].row and rows[1] == -1
    table.remove(timed)
    table.release(timed)
    after = add(table, 10_000)  # its row, without a TTL: not expired by the last object's
    assert after.row == timed.row and after.expires_at == math.inf and table.live_rows([oid(10_000)], 1e18)[0] == after.row


def test_an_extent_is_kept_as_an_offset_and_read_back_whole_from_the_size():
    """A row keeps no length: the size's class, its whole pages (flag PAGED) or no extent
    give the extent back exactly as the arena handed it out (free must get that one)."""
    table = ObjectTable("ns")
    slot = table.add(oid(1), Extent(64 * 7, 128), 100, bytes(16), DESC, Hints(), 1.0)
    paged = table.add(oid(2), Extent(4096 * 3, 4096), 100, bytes(16), DESC, Hints(), 1.0)
    large = table.add(oid(3), Extent(4096 * 9, 3 * 4096), 2 * 4096 + 1, bytes(16), DESC, Hints(), 1.0)
    none = table.add(oid(4), None, 10, bytes(16), DESC, Hints(), 1.0)
    assert (slot.extent, paged.extent, large.extent, none.extent) == (
        Extent(448, 128), Extent(12288, 4096), Extent(36864, 12288), None)
    assert (slot.offset, paged.offset, large.offset) == (448, 12288, 36864)
    zombie = table.add(oid(5), Extent(4096 * 20, 4096), 4000, bytes(16), DESC, Hints(), 1.0)
    zombie.readers = 1
    table.remove(zombie)
    table.remove(none)
    assert table.extents_still_read() == [Extent(4096 * 20, 4096)]
    for extent, size in ((Extent(100, 128), 100), (Extent(0, 192), 100), (Extent(0, 8192), 100), (Extent(0, 4096), 5000)):
        with pytest.raises(ValueError, match="not where the arena puts"):
            table.add(oid(9), extent, size, bytes(16), DESC, Hints(), 1.0)
    assert oid(9) not in table and table.end == 5  # refused before a row was taken
    table.check_integrity()


def test_offset_size_and_kind_widen_when_a_value_needs_it_and_every_row_reads_back():
    table = ObjectTable("ns")
    narrow = [add(table, i) for i in range(100)]
    assert (table.c_offset.dtype, table.c_size.dtype, table.c_kind.dtype) == (np.uint32, np.uint32, np.uint16)
    far = table.add(oid(1000), Extent(1 << 40, 4096), 4096, bytes(16), DESC, Hints(), 1.0)  # past 256 GiB
    assert table.c_offset.dtype == np.uint64 and table.c_size.dtype == np.uint32
    huge = table.add(oid(1001), Extent(4096, 5 << 30), 5 << 30, bytes(16), DESC, Hints(), 1.0)  # 5 GiB
    assert table.c_size.dtype == np.uint64
    kinds = [table.add(oid(2000 + i), Extent(64 * i, 64), 10, bytes(16), StateDescriptor("t", f"m{i}", "r"), Hints(), 1.0)
             for i in range(1 << 16)]
    assert table.c_kind.dtype == np.uint32 and len(table.kinds) == (1 << 16) + 1
    assert far.extent == Extent(1 << 40, 4096) and huge.size == 5 << 30 and huge.extent == Extent(4096, 5 << 30)
    assert all(e.size == 100 + i and e.descriptor is DESC for i, e in enumerate(narrow))
    assert kinds[-1].descriptor == StateDescriptor("t", "m65535", "r") and kinds[0].descriptor.model == "m0"
    table.check_integrity()
    for e in [far, huge, *kinds]:
        table.remove(e)
        table.release(e)
    assert table.compact(no_policy)  # mostly unused now: moved into new columns, still wide
    assert all(table[oid(i)].size == 100 + i for i in range(100))
    table.check_integrity()


def test_hits_saturate_where_write_after_hits_stops():
    table = ObjectTable("ns")
    e = add(table, 1)
    e.num_hits = MAX_HITS - 1
    e.num_hits += 1
    e.num_hits += 1
    assert e.num_hits == MAX_HITS == MAX_WRITE_AFTER_HITS == np.iinfo(table.c_hits.dtype).max


def _columns(table: ObjectTable, rows) -> list:
    """Every field of each row but its serial and its creation time."""
    names = ("ids", "hash", "offset", "size", "checksum", "hits", "readers", "flags", "kind")
    return [[getattr(table, "c_" + name)[row].tolist() for name in names] for row in rows]


def test_a_batch_is_added_as_each_object_would_be_alone():
    """add_many: the rows it takes (released ones first, last released first), their fields,
    the pair kept once, the slots through a rebuild, and the entries read back as add's."""
    alone, batch = ObjectTable("ns"), ObjectTable("ns")
    for table in (alone, batch):
        first = [add(table, i) for i in range(40)]
        for entry in first[5:25:2]:  # ten rows released, to be reused
            table.remove(entry)
            table.release(entry)
        pinned = table.get(oid(31))
        pinned.pinned_until = math.inf
        table.remove(pinned)
        table.release(pinned)  # its row is reused: the pin must not carry over
    ids, sizes = [oid(i) for i in range(1000, 1300)], [100 + i % 5000 for i in range(300)]
    extents = [Extent(i * 8192, -(-size // 4096) * 4096) for i, size in enumerate(sizes)]
    checksums = [bytes([i % 256]) * 16 for i in range(300)]
    singles = [alone.add(o, e, s, c, DESC, Hints(), 10.0) for o, e, s, c in zip(ids, extents, sizes, checksums)]
    rows, serial = batch.add_many(ids, extents, sizes, b"".join(checksums), DESC, Hints(), 10.0)
    assert rows.tolist() == [e.row for e in singles]
    assert _columns(batch, rows) == _columns(alone, rows)
    assert batch.c_serial[rows].tolist() == list(range(serial, serial + 300))
    assert not batch.pins and len(batch.kinds) == len(alone.kinds) == 1
    for o, e, s, c in zip(ids, extents, sizes, checksums):
        got = batch[o]
        assert (got.extent, got.size, got.checksum, got.descriptor, got.hints) == (e, s, c, DESC, Hints())
    batch.check_integrity()
    assert len(batch) == len(alone) == 40 - 11 + 300


def test_a_batch_with_an_indexed_or_repeated_id_or_a_stray_extent_changes_nothing():
    table = ObjectTable("ns")
    add(table, 1)
    extent = Extent(4096, 4096)
    for ids, extents in (([oid(2), oid(1)], [extent, extent]), ([oid(2), oid(2)], [extent, extent]),
                         ([oid(2), oid(3)], [extent, Extent(4096 + 8, 4096)])):
        with pytest.raises((RuntimeError, ValueError)):
            table.add_many(ids, extents, [100, 100], bytes(32), DESC, Hints(), 10.0)
        assert len(table) == 1 and table.end == 1 and oid(2) not in table
        table.check_integrity()
    with pytest.raises(ValueError, match="route or TTL"):
        table.add_many([oid(2)], [extent], [100], bytes(16), DESC, Hints(ttl_s=1.0), 10.0)
