"""SlabAllocator: size classes below one page, so a small object takes a slot near its own size
instead of a whole 4 KiB page.

A slab is a run of pages taken from the page allocator (an ExtentAllocator) and carved into
equal slots of one size class; objects larger than the largest class take pages directly,
page-aligned as before (CUDA pinning, O_DIRECT copies and GPU copies like them whole).

    SIZE_CLASSES: 64 to 448 in steps of 64, then four classes per doubling from 512 to 3584
                  (x1.25, x1.5, x1.75, x2): each at most 1.25x the one below from 512 up, so
                  an object of 512 B to 4 KiB takes less than 1.25x its size.
    slab_bytes(c) = lcm(c, page): the fewest pages that c divides (1 to 7), so no slab has a tail.

    alloc(n):  n > SIZE_CLASSES[-1]: return pages.alloc(n)
               c = the smallest class >= n
               slab = the lowest-offset slab of class c with a free slot,
                      or a new one: pages.alloc(slab_bytes(c))  (None when no room)
               i = slab's most recently freed slot (else its lowest)
               return Extent(slab.offset + i * c, c)
    free(e):   e.length >= page: pages.free(e)
               slab = the slab holding e's first page; e must be one of its taken slots
               give the slot back; if the slab is now empty, pages.free(the slab)

So an extent shorter than a page is a slot and one of whole pages is not: free tells them
apart by length and nothing else changes for callers. Extents stay `Extent(offset, length)`
with `length` the bytes the object takes (its class, or whole pages); `used_bytes` sums them,
and `slab_free_bytes` counts the free slots, which only objects of their class can use.

A class whose slabs are full needs a slot freed in that class or a whole free run of
slab_bytes(c); the page allocator's free bytes alone may not give one. Callers that make room
evict until `can_alloc` says yes (server/tiering/host.py): each round frees at least one
object, so it ends, at the latest when nothing evictable is left.

Slots are aligned to 64 bytes at least (every class is a multiple of 64). Reuse of a slot is
the caller's business like reuse of any extent: the host tier frees an extent only once no
lease or hold covers it. Not thread-safe: the daemon's event loop thread is the only caller.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.policy.base import outgrown
from kvstore.tiers.allocator import Extent, ExtentAllocator

SIZE_CLASSES = (
    *range(64, 512, 64),
    512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584,
)
# Objects larger than the largest class take whole pages: 3585..4096 B wastes at most 14%.
LARGEST_CLASS = SIZE_CLASSES[-1]
# The class of a size of n 64-byte units (every class is a multiple of 64): a tuple index is
# what the host index pays to learn an extent's length from the object's size.
_CLASS_OF_UNITS = tuple(SIZE_CLASSES[bisect_left(SIZE_CLASSES, units * 64)] for units in range(LARGEST_CLASS // 64 + 1))


def footprint(size_bytes: int, page: int) -> int:
    """The bytes an object of size_bytes (> 0) takes: its size class, or whole pages."""
    if size_bytes <= LARGEST_CLASS:
        return _CLASS_OF_UNITS[-(-size_bytes // 64)]
    return -(-size_bytes // page) * page


@dataclass(slots=True)
class Slab:
    """One slab: pages [offset, offset + num_slots * size_class) carved into slots."""

    offset: int
    size_class: int
    num_slots: int
    free: list[int]  # free slot indices; the last is handed out next
    taken: bytearray  # 1 per slot in use

    @property
    def length(self) -> int:
        return self.num_slots * self.size_class


class SlabAllocator:
    """Extents of [0, pages.capacity_bytes): slots of a size class below a page, pages above.

    Owns `pages`: nobody else allocates from it. Event loop thread only.
    """

    def __init__(self, pages: ExtentAllocator):
        if pages.num_allocated:
            raise InvalidArgument("SlabAllocator needs an empty page allocator")
        self._pages = pages
        self._page = pages.alignment
        self._slabs: dict[int, Slab] = {}  # page index -> the slab covering that page
        self._partial: dict[int, list[int]] = {c: [] for c in SIZE_CLASSES}  # offsets of slabs with free slots
        self._num_slabs = 0
        self._slab_bytes = 0  # bytes of pages held by slabs
        self._num_slots = 0  # slots in use
        self._slot_bytes = 0  # bytes of slots in use

    # -- queries ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._pages.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the extents handed out: slots at their class size, pages whole."""
        return self._pages.used_bytes - self._slab_bytes + self._slot_bytes

    @property
    def slab_free_bytes(self) -> int:
        """Free slots inside slabs: free, but only for objects of their size class."""
        return self._slab_bytes - self._slot_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes of free pages; used + slab_free + free = capacity."""
        return self._pages.free_bytes

    @property
    def num_allocated(self) -> int:
        """Extents handed out and not freed (slots and page extents)."""
        return self._pages.num_allocated - self._num_slabs + self._num_slots

    @property
    def num_slabs(self) -> int:
        return self._num_slabs

    @property
    def largest_free_bytes(self) -> int:
        """The largest page extent alloc could return now (0 when no page is free)."""
        return self._pages.largest_free_bytes

    def footprint(self, size_bytes: int) -> int:
        """The bytes an object of size_bytes takes: its class, or whole pages."""
        self._class_of(size_bytes)  # (checks it)
        return footprint(size_bytes, self._page)

    def slab_bytes(self, size_class: int) -> int:
        """Bytes of one slab of `size_class`: the fewest whole pages it divides."""
        return math.lcm(size_class, self._page)

    def is_allocated(self, extent: Extent) -> bool:
        if extent.length >= self._page:
            return extent.offset // self._page not in self._slabs and self._pages.is_allocated(extent)
        return self._slot_of(extent) is not None

    def can_alloc(self, size_bytes: int) -> bool:
        """True when alloc(size_bytes) would succeed now. Same validation as alloc."""
        c = self._class_of(size_bytes)
        if c is None:
            return self._pages.can_alloc(size_bytes)
        return bool(self._partial[c]) or self._pages.can_alloc(self.slab_bytes(c))

    # -- changes ------------------------------------------------------------------------------

    def alloc(self, size_bytes: int) -> Extent | None:
        """A slot of the smallest class that holds size_bytes, or whole pages above the
        largest class; None when there is no room. size_bytes <= 0 raises InvalidArgument."""
        c = self._class_of(size_bytes)
        if c is None:
            return self._pages.alloc(size_bytes)
        partial = self._partial[c]
        if partial:
            slab = self._slabs[partial[0] // self._page]
        else:
            slab = self._new_slab(c)
            if slab is None:
                return None
        i = slab.free.pop()
        slab.taken[i] = 1
        if not slab.free:
            del partial[0]  # the lowest-offset partial slab is the one just used
        self._num_slots += 1
        self._slot_bytes += c
        return Extent(slab.offset + i * c, c)

    def alloc_many(self, size_bytes: int, count: int) -> list[Extent]:
        """Up to `count` extents of size_bytes, as many allocs would hand them out (slots
        taken a slab at a time); fewer (maybe none) when there is no more room."""
        c = self._class_of(size_bytes)
        if c is None:
            return self._pages.alloc_many(size_bytes, count)
        extents, partial = [], self._partial[c]
        while len(extents) < count:
            slab = self._slabs[partial[0] // self._page] if partial else self._new_slab(c)
            if slab is None:
                break
            free = slab.free
            taken = free[max(0, len(free) - (count - len(extents))):][::-1]  # as pops take them
            del free[len(free) - len(taken):]
            for i in taken:
                slab.taken[i] = 1
            if not free:
                del partial[0]
            extents += [Extent(slab.offset + i * c, c) for i in taken]
        self._num_slots += len(extents)
        self._slot_bytes += len(extents) * c
        return extents

    def trim_front(self, extent: Extent, nbytes: int) -> Extent:
        """Give back the first `nbytes` (whole pages) of a page extent alloc handed out; the
        rest stays allocated and is returned (ExtentAllocator.trim_front). Not for slots."""
        if not isinstance(extent, Extent) or extent.length < self._page or extent.offset // self._page in self._slabs:
            raise InvalidArgument(f"trim_front({extent!r}): only a page extent alloc handed out can be trimmed")
        return self._pages.trim_front(extent, nbytes)

    def free(self, extent: Extent) -> None:
        """Return an extent alloc handed out. Anything else (double free, a changed length,
        an extent of another allocator) raises InvalidArgument and changes nothing."""
        if not isinstance(extent, Extent):
            raise InvalidArgument(f"free({extent!r}): not an Extent")
        if extent.length >= self._page:
            if extent.offset // self._page in self._slabs:  # a slab's own pages: not handed out
                raise InvalidArgument(f"free({extent!r}): these pages hold a slab; free its slots")
            self._pages.free(extent)
            return
        found = self._slot_of(extent)
        if found is None:
            raise InvalidArgument(
                f"free({extent!r}): not a slot this allocator handed out "
                "(double free, wrong length, or never allocated)"
            )
        slab, i = found
        slab.taken[i] = 0
        slab.free.append(i)
        self._num_slots -= 1
        self._slot_bytes -= slab.size_class
        if len(slab.free) == slab.num_slots:
            self._drop_slab(slab)
        elif len(slab.free) == 1:
            insort(self._partial[slab.size_class], slab.offset)

    def compact(self) -> bool:
        """Housekeeping: rebuild the page -> slab map and the page allocator's maps once frees
        left them mostly empty (dicts keep their peak's table). True if any was rebuilt."""
        rebuilt = outgrown(self._slabs)
        if rebuilt:
            self._slabs = dict(self._slabs)
        return self._pages.compact() or rebuilt

    # -- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError describing the first broken invariant. O(pages + slots)."""
        self._pages.check_integrity()
        slabs = {id(s): s for s in self._slabs.values()}.values()
        partial = {o for offsets in self._partial.values() for o in offsets}
        num_slots = slot_bytes = slab_bytes = 0
        for slab in slabs:
            c = slab.size_class
            where = f"slab at {slab.offset} (class {c})"
            if c not in self._partial or slab.length != self.slab_bytes(c):
                raise RuntimeError(f"{where}: not a size class, or {slab.length} bytes long")
            if not self._pages.is_allocated(Extent(slab.offset, slab.length)):
                raise RuntimeError(f"{where}: its pages are not allocated in the page allocator")
            pages = range(slab.offset // self._page, slab.offset // self._page + slab.length // self._page)
            if any(self._slabs.get(p) is not slab for p in pages):
                raise RuntimeError(f"{where}: a page of it maps to another slab")
            taken = sum(slab.taken)
            if (len(set(slab.free)) != len(slab.free) or any(slab.taken[i] for i in slab.free)
                    or taken + len(slab.free) != slab.num_slots):
                raise RuntimeError(f"{where}: free list and taken slots disagree")
            if not taken:
                raise RuntimeError(f"{where}: empty but not given back")
            if bool(slab.free) != (slab.offset in partial):
                raise RuntimeError(f"{where}: listed as partial {slab.offset in partial}, "
                                   f"has {len(slab.free)} free slots")
            num_slots += taken
            slot_bytes += taken * c
            slab_bytes += slab.length
        if sum(s.length // self._page for s in slabs) != len(self._slabs):
            raise RuntimeError("page -> slab map holds pages of no slab")
        for c, offsets in self._partial.items():
            listed = [self._slabs.get(o // self._page) for o in offsets]
            if offsets != sorted(set(offsets)) or any(s is None or s.size_class != c for s in listed):
                raise RuntimeError(f"partial slabs of class {c} unsorted, repeated, gone, or of another class")
        counted = (len(slabs), slab_bytes, num_slots, slot_bytes)
        kept = (self._num_slabs, self._slab_bytes, self._num_slots, self._slot_bytes)
        if counted != kept:
            raise RuntimeError(f"slabs, slab bytes, slots, slot bytes: counted {counted}, kept {kept}")

    # -- internals ----------------------------------------------------------------------------

    def _class_of(self, size_bytes: int) -> int | None:
        if type(size_bytes) is not int or size_bytes <= 0:
            raise InvalidArgument(f"size_bytes must be a positive int, got {size_bytes!r}")
        if size_bytes > LARGEST_CLASS:
            return None
        return SIZE_CLASSES[bisect_left(SIZE_CLASSES, size_bytes)]

    def _slot_of(self, extent: Extent) -> tuple[Slab, int] | None:
        """(slab, slot index) of a taken slot that is exactly `extent`, else None."""
        slab = self._slabs.get(extent.offset // self._page)
        if slab is None or extent.length != slab.size_class:
            return None
        i, rest = divmod(extent.offset - slab.offset, slab.size_class)
        if rest or not 0 <= i < slab.num_slots or not slab.taken[i]:
            return None
        return slab, i

    def _new_slab(self, c: int) -> Slab | None:
        pages = self._pages.alloc(self.slab_bytes(c))
        if pages is None:
            return None
        n = pages.length // c
        slab = Slab(pages.offset, c, n, list(range(n - 1, -1, -1)), bytearray(n))
        first = pages.offset // self._page
        for p in range(first, first + pages.length // self._page):
            self._slabs[p] = slab
        insort(self._partial[c], slab.offset)
        self._num_slabs += 1
        self._slab_bytes += pages.length
        return slab

    def _drop_slab(self, slab: Slab) -> None:
        """An emptied slab: its pages go back to the page allocator."""
        partial = self._partial[slab.size_class]
        i = bisect_left(partial, slab.offset)
        if i < len(partial) and partial[i] == slab.offset:
            del partial[i]
        first = slab.offset // self._page
        for p in range(first, first + slab.length // self._page):
            del self._slabs[p]
        self._pages.free(Extent(slab.offset, slab.length))
        self._num_slabs -= 1
        self._slab_bytes -= slab.length
