import random
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument
from kvstore.tiers.allocator import _MAX_CLASS_SCAN, Extent, ExtentAllocator

ALIGN = 16
UNITS = 64


class Model:
    """The allocator's job done the obvious way: a dict of allocated extents, gaps by scan."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.allocated: dict[int, int] = {}

    def holes(self) -> list[tuple[int, int]]:
        holes, position = [], 0
        for offset in sorted(self.allocated):
            if offset > position:
                holes.append((position, offset - position))
            position = offset + self.allocated[offset]
        if position < self.capacity:
            holes.append((position, self.capacity - position))
        return holes

    def first_fit(self, length: int) -> int | None:
        return next((o for o, n in self.holes() if n >= length), None)


def rounded(size: int, align: int) -> int:
    return -(-size // align) * align


def size_class(length: int, align: int) -> int:
    return (length // align).bit_length() - 1


def check_alloc(a: ExtentAllocator, model: Model, size: int, exact: bool) -> Extent | None:
    length = rounded(size, a.alignment)
    expected = model.first_fit(length)
    assert a.can_alloc(size) == (expected is not None)
    got = a.alloc(size)
    if expected is None:
        assert got is None
        return None
    assert got is not None and got.length == length and got.offset % a.alignment == 0
    assert any(o <= got.offset and got.end <= o + n for o, n in model.holes())
    if got.offset != expected:
        # Allowed only when alloc gave up on a long run of too-small holes of the same class.
        assert not exact
        k = size_class(length, a.alignment)
        skipped = [o for o, n in model.holes() if o < got.offset and size_class(n, a.alignment) == k]
        assert len(skipped) >= _MAX_CLASS_SCAN and size_class(a.largest_free_bytes, a.alignment) > k
    model.allocated[got.offset] = got.length
    return got


def check_stats(a: ExtentAllocator, model: Model) -> None:
    used = sum(model.allocated.values())
    assert (a.used_bytes, a.free_bytes) == (used, model.capacity - used)
    assert a.num_allocated == len(model.allocated)
    holes = model.holes()
    assert a.num_free_extents == len(holes)
    assert a.largest_free_bytes == max((n for _, n in holes), default=0)


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 20 * ALIGN), st.integers(0, 1 << 30)), max_size=150)


def step(a: ExtentAllocator, model: Model, live: list[Extent], is_alloc: bool, size: int, pick: int) -> Extent | None:
    """One op of a random run, checked against the model: alloc, or free a live extent
    (returned)."""
    if is_alloc or not live:
        extent = check_alloc(a, model, size, exact=True)
        if extent is not None:
            live.append(extent)
        return None
    extent = live.pop(pick % len(live))
    a.free(extent)
    del model.allocated[extent.offset]
    return extent


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_ops_match_first_fit_model(steps):
    a, model, live = ExtentAllocator(UNITS * ALIGN, ALIGN), Model(UNITS * ALIGN), []
    for is_alloc, size, pick in steps:
        step(a, model, live, is_alloc, size, pick)
        a.check_integrity()
        check_stats(a, model)


def test_seeded_20k_ops_then_drain_to_one_extent():
    rng = random.Random(20240)
    capacity = 1024 * 4096
    a, model, live = ExtentAllocator(capacity), Model(capacity), []
    for step in range(20_000):
        size = rng.choice([1, 4096, 4097, 3 * 4096, 64 * 1024, rng.randrange(1, 200 * 1024)])
        if live and rng.random() < 0.45:
            extent = live.pop(rng.randrange(len(live)))
            a.free(extent)
            del model.allocated[extent.offset]
        else:
            extent = check_alloc(a, model, size, exact=False)
            if extent is not None:
                live.append(extent)
        if step % 200 == 0:
            a.check_integrity()
            check_stats(a, model)
    assert a.num_allocated > 0
    rng.shuffle(live)
    for extent in live:
        a.free(extent)
    a.check_integrity()
    assert (a.used_bytes, a.num_allocated, a.num_free_extents) == (0, 0, 1)
    assert a.largest_free_bytes == capacity
    assert a.alloc(capacity) == Extent(0, capacity)


def test_fragmentation_then_coalescing_back_to_one_extent():
    a = ExtentAllocator(256 * 4096)
    units = []
    while a.can_alloc(4096):
        units.append(a.alloc(4096))
    assert len(units) == 256 and a.alloc(1) is None
    for extent in units[::2]:
        a.free(extent)
    assert a.num_free_extents == 128 and a.free_bytes == 128 * 4096
    assert a.largest_free_bytes == 4096
    assert not a.can_alloc(2 * 4096) and a.alloc(2 * 4096) is None
    rest = units[1::2]
    random.Random(7).shuffle(rest)
    for extent in rest:
        a.free(extent)
        a.check_integrity()
    assert a.num_free_extents == 1 and a.largest_free_bytes == 256 * 4096


def test_lowest_address_first():
    a = ExtentAllocator(16 * 4096)
    first, second, third = a.alloc(4096), a.alloc(4096), a.alloc(4096)
    assert [e.offset for e in (first, second, third)] == [0, 4096, 8192]
    a.free(second)
    a.free(first)
    assert a.alloc(4096).offset == 0  # the low, warm hole, not the big tail
    assert a.alloc(8192).offset == 3 * 4096  # hole at 4096 is one unit: too small


def test_alignment_rounds_lengths_up():
    a = ExtentAllocator(64 * 4096)
    assert a.alloc(1) == Extent(0, 4096)
    assert a.alloc(4096) == Extent(4096, 4096)
    assert a.alloc(4097) == Extent(8192, 8192)
    assert ExtentAllocator(1024, 64).alloc(65) == Extent(0, 128)


@pytest.mark.parametrize("size", [0, -1, -4096, 1.5, "8", True, None])
def test_bad_sizes_rejected(size):
    a = ExtentAllocator(16 * 4096)
    with pytest.raises(InvalidArgument):
        a.alloc(size)
    with pytest.raises(InvalidArgument):
        a.can_alloc(size)
    assert a.used_bytes == 0


@pytest.mark.parametrize("capacity, alignment", [(0, 4096), (-4096, 4096), (4097, 4096), (4096, 3000), (4096, 0)])
def test_bad_construction_rejected(capacity, alignment):
    with pytest.raises(InvalidArgument):
        ExtentAllocator(capacity, alignment)


def snapshot(a: ExtentAllocator):
    return (a.used_bytes, a.free_bytes, a.num_allocated, a.num_free_extents, a.largest_free_bytes)


def test_double_free_and_foreign_extents_rejected_without_change():
    a, other = ExtentAllocator(64 * 4096), ExtentAllocator(64 * 4096)
    kept, freed = a.alloc(8192), a.alloc(4096)
    other.alloc(4096 * 10)
    a.free(freed)
    before = snapshot(a)
    foreign = [
        freed,  # double free
        Extent(kept.offset, 4096),  # wrong (shorter) length
        Extent(kept.offset, 3 * 4096),  # wrong (longer) length
        Extent(kept.offset + 4096, 4096),  # inside an allocated extent
        Extent(20 * 4096, 4096),  # never allocated
        Extent(1000 * 4096, 4096),  # beyond capacity
        (kept.offset, kept.length),  # not an Extent
    ]
    for extent in foreign:
        with pytest.raises(InvalidArgument):
            a.free(extent)
        assert snapshot(a) == before
        a.check_integrity()
    a.free(kept)
    assert a.used_bytes == 0


def test_exhaustion_returns_none_and_can_alloc_agrees():
    a = ExtentAllocator(8 * 4096)
    assert not a.can_alloc(9 * 4096) and a.alloc(9 * 4096) is None
    big = a.alloc(6 * 4096)
    assert a.can_alloc(2 * 4096) and not a.can_alloc(2 * 4096 + 1)
    assert a.alloc(2 * 4096 + 1) is None
    a.alloc(2 * 4096)
    assert a.free_bytes == 0 and a.largest_free_bytes == 0
    assert not a.can_alloc(1) and a.alloc(1) is None
    a.free(big)
    assert a.can_alloc(6 * 4096) and a.alloc(6 * 4096) == big


def test_long_run_of_small_holes_never_hides_a_fit():
    # More too-small holes of the request's class than alloc scans, then one that fits.
    n = _MAX_CLASS_SCAN + 10
    a = ExtentAllocator((3 * n + 8) * 4096)
    pairs = [(a.alloc(2 * 4096), a.alloc(4096)) for _ in range(n)]
    fits = a.alloc(3 * 4096)
    a.alloc(a.free_bytes)  # no larger hole anywhere
    for hole, _ in pairs:
        a.free(hole)
    a.free(fits)
    assert a.alloc(3 * 4096) == fits  # found despite the scan bound
    a.check_integrity()


def test_check_integrity_catches_corruption():
    a = ExtentAllocator(16 * 4096)
    a.alloc(4096)
    a.check_integrity()
    a._allocated[8192] = 4096  # overlaps the free extent, used_bytes not updated
    with pytest.raises(RuntimeError):
        a.check_integrity()
    b = ExtentAllocator(16 * 4096)
    b._remove_free(0)
    b._add_free(0, 4096)
    b._add_free(4096, 15 * 4096)  # adjacent, not coalesced
    with pytest.raises(RuntimeError, match="coalesced"):
        b.check_integrity()


def test_allocated_at_start_rebuilds_exactly_those_extents_and_the_holes_between():
    from kvstore.tiers.allocator import Extent, ExtentAllocator
    a = ExtentAllocator(64 * 4096, 4096, allocated=([0, 8192, 40960], [4096, 16384, 4096]))
    a.check_integrity()
    assert a.num_allocated == 3 and a.used_bytes == 24576
    assert a.is_allocated(Extent(8192, 16384)) and not a.is_allocated(Extent(4096, 4096))
    assert a.largest_free_bytes == 64 * 4096 - 45056  # the hole after the last extent
    a.free(Extent(8192, 16384))
    a.check_integrity()
    assert ExtentAllocator(8192, 4096, allocated=([], [])).free_bytes == 8192


def initial_extents(draw_pairs) -> tuple[list[int], list[int]]:
    """Sorted, disjoint extents from (gap, length) pairs in alignment units, cut at UNITS."""
    offsets, lengths, position = [], [], 0
    for gap, units in draw_pairs:
        position += gap
        if position + units > UNITS:
            break
        offsets.append(position * ALIGN)
        lengths.append(units * ALIGN)
        position += units
    return offsets, lengths


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=30), ops, st.booleans())
def test_extents_allocated_at_start_answer_as_a_dict_of_them_would(pairs, steps, as_arrays):
    """The extents given at construction live in numpy arrays plus a set of freed ones
    (initial_extents.py), beside the dict of later allocs: every answer must be the one
    the plain dict model gives, through frees, re-allocs of freed offsets and double frees."""
    offsets, lengths = initial_extents(pairs)
    given_extents = (np.array(offsets, np.int64), np.array(lengths, np.int64)) if as_arrays else (offsets, lengths)
    a, model = ExtentAllocator(UNITS * ALIGN, ALIGN, allocated=given_extents), Model(UNITS * ALIGN)
    model.allocated = dict(zip(offsets, lengths))
    live = [Extent(o, n) for o, n in zip(offsets, lengths)]
    freed: list[Extent] = []
    a.check_integrity()
    check_stats(a, model)
    for is_alloc, size, pick in steps:
        freed += filter(None, [step(a, model, live, is_alloc, size, pick)])
        for e in [*live, *freed]:
            assert a.is_allocated(e) == (model.allocated.get(e.offset) == e.length)
        stale = [e for e in freed if model.allocated.get(e.offset) != e.length]
        if stale:
            with pytest.raises(InvalidArgument):
                a.free(stale[pick % len(stale)])  # double free: refused, nothing changes
        a.check_integrity()
        check_stats(a, model)


@pytest.mark.parametrize("offsets, lengths", [
    ([0, 4096], [8192, 4096]),  # overlap
    ([8192, 0], [4096, 4096]),  # unsorted
    ([100], [4096]),  # unaligned offset
    ([0], [100]),  # unaligned length
    ([0], [0]),  # empty extent
    ([60 * 4096], [8 * 4096]),  # runs past the end
    ([-4096], [4096]),
    ([0, 4096], [4096]),  # lengths missing
])
def test_bad_extents_allocated_at_start_rejected(offsets, lengths):
    with pytest.raises(InvalidArgument):
        ExtentAllocator(64 * 4096, 4096, allocated=(offsets, lengths))


def test_trim_front_gives_back_the_front_and_keeps_the_rest_allocated():
    a = ExtentAllocator(UNITS * ALIGN, ALIGN)
    left, e, right = a.alloc(2 * ALIGN), a.alloc(8 * ALIGN), a.alloc(ALIGN)
    a.free(left)
    kept = a.trim_front(e, 3 * ALIGN)
    assert kept == Extent(e.offset + 3 * ALIGN, 5 * ALIGN) and a.is_allocated(kept)
    assert not a.is_allocated(e) and a.used_bytes == 6 * ALIGN
    assert a.alloc(5 * ALIGN) == Extent(0, 5 * ALIGN)  # the front merged with the hole before it
    a.check_integrity()
    with pytest.raises(InvalidArgument):
        a.free(e)  # the old extent is no longer one
    a.free(kept)
    a.free(right)
    a.free(Extent(0, 5 * ALIGN))
    assert a.used_bytes == 0 and a.num_free_extents == 1
    a.check_integrity()


@pytest.mark.parametrize("nbytes", [0, -ALIGN, ALIGN // 2, 4 * ALIGN, 5 * ALIGN, 1.5])
def test_bad_trims_raise_and_change_nothing(nbytes):
    a = ExtentAllocator(UNITS * ALIGN, ALIGN)
    e = a.alloc(4 * ALIGN)
    with pytest.raises(InvalidArgument):
        a.trim_front(e, nbytes)
    with pytest.raises(InvalidArgument):
        a.trim_front(Extent(e.offset, 2 * ALIGN), ALIGN)  # not what alloc handed out
    assert a.is_allocated(e) and a.used_bytes == 4 * ALIGN
    a.check_integrity()


def test_compact_rebuilds_the_maps_that_frees_emptied_and_nothing_else_changes():
    """A dict keeps the table of its peak: after 20,000 extents come and go, compact gives the
    tables back, once, and the allocator answers as before."""
    a = ExtentAllocator(40_000 * 4096, 4096)
    got = a.alloc_many(4096, 20_000)
    kept = got[::2][:10]
    assert not a.compact()  # full: nothing to give back
    peak = sys.getsizeof(a._allocated)
    for x in got:
        if x not in kept:
            a.free(x)
    assert a.compact() and sys.getsizeof(a._allocated) < peak // 100
    assert not a.compact()  # once is enough
    a.check_integrity()
    assert a.num_allocated == len(kept) and all(a.is_allocated(x) for x in kept)
    more = a.alloc_many(4096, 5)
    for x in [*kept, *more]:
        a.free(x)
    assert a.num_allocated == 0 and a.free_bytes == a.capacity_bytes
    a.check_integrity()
