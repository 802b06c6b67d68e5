import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument
from kvstore.tiers.allocator import Extent, ExtentAllocator
from kvstore.tiers.slabs import LARGEST_CLASS, SIZE_CLASSES, SlabAllocator

PAGE = 4096


def slabs(capacity: int = 64 * PAGE) -> SlabAllocator:
    return SlabAllocator(ExtentAllocator(capacity, PAGE))


def test_small_objects_waste_under_a_quarter_from_512_bytes_to_4_kib():
    a = slabs()
    for size in range(512, PAGE + 1):
        assert a.footprint(size) / size - 1 < 0.25, size
    assert a.footprint(1024) == 1024 and a.footprint(513) == 640 and a.footprint(3585) == PAGE


@pytest.mark.parametrize("c", SIZE_CLASSES)
def test_every_class_fills_a_slab_reuses_its_slots_and_returns_it_emptied(c):
    a = slabs()
    per_slab = a.slab_bytes(c) // c
    assert a.slab_bytes(c) % PAGE == 0 and per_slab >= 2
    got = [a.alloc(c - 1 if c > 64 else c) for _ in range(per_slab)]
    assert all(x.length == c and x.offset % 64 == 0 for x in got)
    assert sorted(x.offset for x in got) == [got[0].offset + i * c for i in range(per_slab)]  # one slab, packed
    assert a.num_slabs == 1 and a.used_bytes == per_slab * c and a.slab_free_bytes == 0
    assert a.free_bytes == a.capacity_bytes - a.slab_bytes(c)
    a.free(got[3 % per_slab])
    assert a.slab_free_bytes == c and a.alloc(c) == got[3 % per_slab]  # the freed slot comes back
    extra = a.alloc(c)  # the slab is full: a second one
    assert a.num_slabs == 2 and not got[0].offset <= extra.offset < got[0].offset + a.slab_bytes(c)
    for x in [*got, extra]:
        a.check_integrity()
        a.free(x)
    assert a.num_slabs == 0 and a.used_bytes == 0 and a.free_bytes == a.capacity_bytes
    assert a.num_allocated == 0
    a.check_integrity()


def test_objects_above_the_largest_class_take_whole_aligned_pages():
    a = slabs()
    small = a.alloc(100)
    for size, length in ((LARGEST_CLASS + 1, PAGE), (PAGE, PAGE), (PAGE + 1, 2 * PAGE), (5 * PAGE, 5 * PAGE)):
        x = a.alloc(size)
        assert x.length == length and x.offset % PAGE == 0 and a.is_allocated(x)
        assert x.end <= small.offset or x.offset >= small.offset + a.slab_bytes(small.length)
    a.check_integrity()


def test_bad_frees_raise_and_change_nothing():
    a = slabs()
    slot = a.alloc(1000)
    page = a.alloc(PAGE)
    before = (a.used_bytes, a.num_allocated, a.slab_free_bytes)
    for bad in (Extent(slot.offset, 512),                 # wrong length
                Extent(slot.offset + 64, 1024),           # inside a slot
                Extent(slot.offset + 1024, 1024),         # a free slot of the slab
                Extent(slot.offset, PAGE),                # the slab's own page
                Extent(page.offset + PAGE, 1024),         # a page that holds no slab
                (slot.offset, slot.length)):              # not an Extent
        with pytest.raises(InvalidArgument):
            a.free(bad)
        if isinstance(bad, Extent):
            assert not a.is_allocated(bad)
    assert (a.used_bytes, a.num_allocated, a.slab_free_bytes) == before
    a.free(slot)
    with pytest.raises(InvalidArgument):
        a.free(slot)  # double free
    a.check_integrity()
    with pytest.raises(InvalidArgument):
        a.alloc(0)


def test_a_full_class_cannot_allocate_while_another_class_has_free_slots():
    a = slabs(capacity=3 * PAGE)  # one slab of 768 B (3 pages) fills it
    got = [a.alloc(768) for _ in range(a.slab_bytes(768) // 768)]
    a.free(got[0])
    assert a.slab_free_bytes == 768 and a.free_bytes == 0
    assert not a.can_alloc(1024) and a.alloc(1024) is None  # its free slot is 768's only
    assert a.can_alloc(700) and a.alloc(700) == got[0]
    a.check_integrity()


def test_a_slab_needs_its_pages_contiguous():
    a = slabs(capacity=8 * PAGE)
    pages = [a.alloc(PAGE) for _ in range(8)]
    for i in (0, 2, 4, 6):
        a.free(pages[i])
    assert a.free_bytes == 4 * PAGE and a.slab_bytes(640) == 5 * PAGE
    assert not a.can_alloc(640) and a.alloc(640) is None  # 5 pages, no run that long
    assert a.can_alloc(1024) and a.alloc(1024).offset == 0  # a one-page slab fits a hole
    a.check_integrity()


class Model:
    """What the allocator must keep: the live extents, and a byte pattern in each that no other
    extent may overwrite."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.live: dict[int, tuple[Extent, int]] = {}  # offset -> (extent, tag)
        self.memory = bytearray(capacity)

    def add(self, x: Extent, tag: int) -> None:
        assert x.offset not in self.live and x.end <= self.capacity
        self.live[x.offset] = (x, tag)
        self.memory[x.offset:x.end] = bytes([tag]) * x.length

    def check(self) -> None:
        spans = sorted((x.offset, x.end) for x, _ in self.live.values())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "live extents overlap"
        for x, tag in self.live.values():
            assert self.memory[x.offset:x.end] == bytes([tag]) * x.length


SIZES = st.one_of(st.integers(1, LARGEST_CLASS), st.sampled_from([512, 1024, 2048, 3072, 4096]),
                  st.integers(LARGEST_CLASS + 1, 3 * PAGE))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 10 ** 6)), min_size=1, max_size=300))
def test_random_allocs_and_frees_match_a_model(ops):
    a = slabs(capacity=24 * PAGE)
    model = Model(a.capacity_bytes)
    for tag, (is_alloc, size, pick) in enumerate(ops):
        if is_alloc or not model.live:
            could = a.can_alloc(size)
            x = a.alloc(size)
            assert could == (x is not None)
            if x is None:
                c = a.footprint(size)
                if c < PAGE:  # every slab of its class full, and no run of pages for a new one
                    per_slab = a.slab_bytes(c) // c
                    assert sum(1 for y, _ in model.live.values() if y.length == c) % per_slab == 0
                    assert a.largest_free_bytes < a.slab_bytes(c)
                else:
                    assert a.largest_free_bytes < c
                continue
            assert x.length == a.footprint(size) >= size
            assert x.offset % (PAGE if x.length >= PAGE else math.gcd(x.length, PAGE)) == 0
            model.add(x, tag % 251 + 1)
        else:
            x, _ = model.live.pop(sorted(model.live)[pick % len(model.live)])
            a.free(x)
        model.check()
        assert a.num_allocated == len(model.live)
        assert a.used_bytes == sum(x.length for x, _ in model.live.values())
        assert a.used_bytes + a.slab_free_bytes + a.free_bytes == a.capacity_bytes
    a.check_integrity()
    for x, _ in list(model.live.values()):
        a.free(x)
    assert a.used_bytes == 0 and a.num_slabs == 0 and a.free_bytes == a.capacity_bytes
    a.check_integrity()


def test_check_integrity_finds_a_slot_lost_from_the_free_list():
    a = slabs()
    a.alloc(100)
    a.check_integrity()
    a._partial[128][:] = []  # a partial slab no longer listed: its free slots would leak
    with pytest.raises(RuntimeError, match="partial"):
        a.check_integrity()


def test_trim_front_takes_page_extents_only():
    s = slabs()
    slot, pages = s.alloc(1000), s.alloc(3 * PAGE)
    kept = s.trim_front(pages, PAGE)
    assert kept == Extent(pages.offset + PAGE, 2 * PAGE) and s.is_allocated(kept)
    used = s.used_bytes
    with pytest.raises(InvalidArgument):
        s.trim_front(slot, PAGE)  # a slot
    slab_pages = Extent(slot.offset - slot.offset % PAGE, s.slab_bytes(1024))
    with pytest.raises(InvalidArgument):
        s.trim_front(slab_pages, PAGE)  # a slab's own pages
    assert s.used_bytes == used
    s.free(kept)
    s.free(slot)
    assert s.used_bytes == 0


@pytest.mark.parametrize("size", [100, 3000, LARGEST_CLASS + 1, 3 * PAGE])
def test_a_batch_of_allocs_hands_out_what_allocs_one_by_one_would(size):
    """alloc_many against alloc, on allocators with the same frees behind them (holes in
    pages and in slabs): the same extents in the same order, then the same 'no room'."""
    one, many = slabs(), slabs()
    for allocator in (one, many):
        taken = [allocator.alloc(s) for s in [100, 3000, 2 * PAGE, 700] * 12]
        for extent in taken[::3]:
            allocator.free(extent)
    singles = []
    while (extent := one.alloc(size)) is not None:
        singles.append(extent)
    batch = many.alloc_many(size, 7) + many.alloc_many(size, 10_000)
    assert batch == singles and many.alloc_many(size, 5) == []
    for allocator in (one, many):
        allocator.check_integrity()
    for extent in batch:
        many.free(extent)
    many.check_integrity()


def test_compact_gives_back_the_page_maps_and_then_the_slab_columns_once_slabs_go():
    """11,000 one-page slabs (class 2048, two slots each), then all but one freed: compact gives
    the page allocator's maps back and the survivor stays as it was; once it goes too, the
    slab columns start over. Each rebuild happens once."""
    c = 2048
    a = slabs(12_000 * PAGE)
    got = a.alloc_many(c, 22_000)
    assert len(got) == 22_000 and a.num_slabs == 11_000 and not a.compact()
    peak = sys.getsizeof(a._pages._allocated)
    kept = got[:2]  # the first slab's slots
    for x in got[2:]:
        a.free(x)
    assert a.num_slabs == 1 and a.compact() and sys.getsizeof(a._pages._allocated) < peak // 100
    assert not a.compact()
    a.check_integrity()
    extra = a.alloc(c)
    assert all(a.is_allocated(x) for x in kept) and extra.offset not in {x.offset for x in kept}
    for x in [extra, *kept]:
        a.free(x)
    assert a.num_slabs == 0 and a.compact() and len(a._offset) == 0 and not a.compact()
    a.check_integrity()
    assert a.alloc(c) == Extent(0, c)  # new columns serve as the first did


def test_pages_that_would_make_slabs_of_more_than_64_slots_are_refused_by_name():
    with pytest.raises(InvalidArgument, match="more than 64 slots"):
        SlabAllocator(ExtentAllocator(64 * 8192, 8192))
