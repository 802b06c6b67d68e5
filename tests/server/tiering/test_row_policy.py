"""server/tiering/row_policy.py: the host tier's eviction policies over an ObjectTable's rows must
choose exactly the victims their references (kvstore/policy/) choose, through row reuse,
stale places and compactions, and keep their state in columns."""

import random

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.policy import POLICIES
from kvstore.server.tiering.object_table import HASH_MASK, ObjectTable
from kvstore.server.tiering.row_policy import ROW_POLICIES, make_row_policy
from kvstore.tiers.allocator import Extent

DESC = StateDescriptor("t", "m", "r")
CHECKSUM = bytes(16)


def oid(i: int) -> ObjectId:
    return ObjectId(random.Random(i).randbytes(32))


class Both:
    """An ObjectTable with a row policy, and the reference policy over ids, changed together."""

    def __init__(self, name: str, capacity: int):
        self.table = ObjectTable("t")
        self.policy = make_row_policy(name, self.table, capacity)
        self.reference = POLICIES[name](capacity)

    def insert(self, i: int, size: int, priority: int = 0, cost: float | None = None) -> None:
        entry = self.table.add(oid(i), None, size, CHECKSUM, DESC, Hints(priority=priority, recompute_cost_ms=cost), 0.0)
        self.policy.on_insert(entry.row)
        self.reference.on_insert(oid(i), size, cost, priority)

    def access(self, i: int) -> None:
        entry = self.table.get(oid(i))
        if entry is not None:
            self.policy.on_access(entry.locate())
        self.reference.on_access(oid(i))

    def drop(self, entry, tracked: bool = True) -> None:
        self.table.remove(entry)
        if tracked:
            self.policy.on_remove(entry.row)
        self.table.release(entry)  # its row may go to the next object

    def remove(self, i: int) -> None:
        entry = self.table.get(oid(i))
        if entry is not None:
            self.drop(entry)
        self.reference.on_remove(oid(i))

    def victims(self, need: int, kept: set) -> list[ObjectId]:
        rows = self.policy.victims(need, lambda row: self.table.entry_at(row).object_id not in kept)
        chosen = [self.table.entry_at(row) for row in rows]
        assert [e.object_id for e in chosen] == self.reference.victims(need, lambda key: key not in kept)
        for entry in chosen:
            self.drop(entry, tracked=False)
        return [e.object_id for e in chosen]

    def compact(self) -> bool:
        return self.table.compact(self.policy.renumber) | self.policy.compact()

    def check(self) -> None:
        assert (len(self.policy), self.policy.tracked_bytes) == (len(self.reference), self.reference.tracked_bytes)
        assert self.policy.tracks_exactly(self.table.indexed_rows())
        self.policy.check_integrity()
        self.reference.check_integrity()


@pytest.mark.parametrize("name", sorted(ROW_POLICIES))
@pytest.mark.parametrize("seed", [1, 2])
def test_the_row_policy_chooses_its_reference_s_victims(name, seed):
    rng = random.Random(seed)
    both = Both(name, 10**6)
    kept = {oid(j) for j in range(0, 3000, 7)}  # pinned or read: never a victim
    chosen = 0
    for step in range(8000):
        op, i = rng.random(), rng.randrange(3000)
        if op < 0.4 and oid(i) not in both.table:
            cost = rng.choice([None, 0.5, 20.0])
            both.insert(i, rng.choice([1000, 4096, 50_000]), rng.randint(-10, 10), cost)
        elif op < 0.7:
            both.access(i)
        elif op < 0.85:
            both.remove(i)
        elif op < 0.999:
            chosen += len(both.victims(rng.randrange(1, 200_000), kept))
        else:
            both.compact()
        if step % 1000 == 0:
            both.check()
    both.check()
    assert chosen > 500  # the comparison covered many victims, and the ghost path (s3fifo)


@pytest.mark.parametrize("name", sorted(ROW_POLICIES))
def test_a_compaction_moves_the_policy_with_the_rows(name):
    both = Both(name, 10**9)
    for i in range(12_000):
        both.insert(i, 4096 + i % 3)
    for i in range(0, 12_000, 3):
        both.access(i)
    for i in range(12_000):
        if i % 8:
            both.remove(i)
    rows = len(both.policy.c_state)
    assert both.compact() and len(both.policy.c_state) < rows / 4  # the table moved its rows
    both.check()
    for i in range(20_000, 21_000):  # new objects take rows after the moved ones
        both.insert(i, 100)
    both.access(16)
    while len(both.reference):
        both.victims(50_000, set())
    both.check()
    assert len(both.table) == 0 and both.compact() and len(both.policy.c_state) <= 64  # started over
    both.insert(7, 10)
    both.check()


def test_a_reused_row_takes_a_new_place_and_its_old_one_is_skipped():
    both = Both("s3fifo", 10**6)
    both.insert(1, 1000)
    row = both.table[oid(1)].row
    both.remove(1)
    both.insert(2, 2000)  # the row just released
    assert both.table[oid(2)].row == row
    assert both.victims(1, set()) == [oid(2)]
    both.check()


def test_the_ghost_sends_an_id_seen_again_straight_to_main():
    both = Both("s3fifo", 10_000)
    for i in range(3):
        both.insert(i, 3000)
    assert both.victims(1, set()) == [oid(0)]
    both.insert(0, 3000)  # back soon after: main, by its id's hash, on a row of its own
    assert both.policy.m_state[both.table[oid(0)].row] & 4  # IN_MAIN
    both.check()


def test_policy_state_is_columns_not_per_key_objects():
    both = Both("s3fifo", 10**9)
    for i in range(5000):
        both.insert(i, 100)
    assert both.policy.c_state.dtype == np.uint8 and both.policy.c_gen.dtype == np.uint32
    assert not hasattr(both.policy, "_entries")  # no dict of keys (kvstore/policy/base.py keeps one)
    assert both.policy._small.items().dtype == np.int64 and len(both.policy._small) == 5000


def test_bad_input_is_refused_and_changes_nothing():
    table = ObjectTable("t")
    with pytest.raises(InvalidArgument, match="unknown eviction policy 'fifo'.*cost_aware, lru, s3fifo"):
        make_row_policy("fifo", table, 100)
    with pytest.raises(InvalidArgument, match="positive integer"):
        make_row_policy("lru", table, 0)
    policy = make_row_policy("s3fifo", table, 100)
    entry = table.add(oid(1), None, 10, CHECKSUM, DESC, Hints(), 0.0)
    policy.on_insert(entry.row)
    policy._ghost.remember(table.m_hash[entry.row], 10)  # as if it had been evicted too (it cannot)
    with pytest.raises(InvalidArgument, match="already tracked"):
        policy.on_insert(entry.row)
    assert len(policy) == 1 and policy.tracked_bytes == 10 and len(policy._ghost) == 1  # nothing changed
    assert policy._ghost.take(table.m_hash[entry.row])
    policy.on_remove(entry.row)
    policy.on_remove(entry.row)  # idempotent
    policy.on_access(10**6)  # a row never tracked: ignored
    assert len(policy) == 0 and policy.victims(100, lambda row: True) == []
    policy.check_integrity()


def test_the_integrity_check_catches_a_lost_place():
    both = Both("lru", 10**6)
    for i in range(10):
        both.insert(i, 10)
    both.policy._order.popleft()
    with pytest.raises(RuntimeError, match="no live place"):
        both.policy.check_integrity()


def test_the_ghost_is_rebuilt_only_once_it_is_sparse():
    both = Both("s3fifo", 10**6)
    for i in range(6000):
        both.insert(i, 10)
    both.victims(6000 * 10, set())  # all from S: each id to the ghost
    ghost = both.policy._ghost.sizes
    both.policy.compact()  # (S's drained buffer is given back)
    # The ghost keeps 32 bits of each id's keyed hash: two of 6,000 ids share one ~0.4% of runs.
    hashes = [hash(oid(i)) & HASH_MASK for i in range(6000)]
    assert len(ghost) == len(set(hashes)) and both.policy._ghost.sizes is ghost  # full, not sparse: kept as it is
    for i in range(5000):
        both.insert(i, 10)  # seen again: out of the ghost, into M
    left = len(set(hashes[5000:]) - set(hashes[:5000]))
    assert both.compact() and both.policy._ghost.sizes is not ghost and len(both.policy._ghost) == left
    ghost = both.policy._ghost.sizes
    both.policy.compact()
    assert both.policy._ghost.sizes is ghost  # once is enough
    both.check()


@pytest.mark.parametrize("name", sorted(ROW_POLICIES))
def test_a_batch_inserted_at_once_is_queued_as_one_by_one(name):
    """on_insert_many against on_insert row by row, over reused rows, after victims left some
    ids in the ghost (S3-FIFO sends those to M): the same victims, in the same order."""
    alone, batch = Both(name, 200_000), Both(name, 200_000)
    for both in (alone, batch):
        for i in range(60):
            both.insert(i, 4096)
        both.victims(100_000, set())  # S's victims go to the ghost, their rows free
    ids = list(range(0, 120, 2))  # some back from the ghost, some new
    for i in ids:
        if oid(i) not in alone.table:
            alone.insert(i, 4096)
    fresh = [i for i in ids if oid(i) not in batch.table]
    rows, _ = batch.table.add_many([oid(i) for i in fresh], [Extent(i * 4096, 4096) for i in fresh], [4096] * len(fresh),
                                   bytes(16 * len(fresh)), DESC, Hints(), 0.0)
    ghosts = len(getattr(batch.policy, "_ghost", ()))
    batch.policy.on_insert_many(rows)
    if name != "lru":  # the batch had ids the ghost remembered: those went to M
        assert len(batch.policy._ghost) < ghosts and len(batch.policy._main)
    for i in fresh:
        batch.reference.on_insert(oid(i), 4096, None, 0)
    for both in (alone, batch):
        both.check()
    with pytest.raises(InvalidArgument, match="already tracked"):
        batch.policy.on_insert_many(batch.table.indexed_rows()[-3:])
    batch.check()
    assert alone.victims(400_000, set()) == batch.victims(400_000, set())
