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
               i = slab's lowest free slot
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

The slabs are columns, not Python objects: per slab number its offset, its class and a 64-bit
mask of its free slots (a class that is a multiple of 64 divides into at most 64 slots of a
4 KiB page's slab), and per page of the arena the number of the slab on it. So a million small
objects leave no Python object per slab behind in the allocator's arenas once they go.

Slots are aligned to 64 bytes at least (every class is a multiple of 64). Reuse of a slot is
the caller's business like reuse of any extent: the host tier frees an extent only once no
lease or hold covers it. Not thread-safe: the daemon's event loop thread is the only caller.
"""

from __future__ import annotations

import math
import mmap
from array import array
from bisect import bisect_left, insort

import numpy as np

from kvstore.errors import InvalidArgument
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


# A slab's free slots are the bits of one 64-bit mask.
MAX_SLOTS = 64
# Slab columns shorter than this are kept as they are once emptied.
_MIN_COLUMNS = 1024


class SlabAllocator:
    """Extents of [0, pages.capacity_bytes): slots of a size class below a page, pages above.

    Owns `pages`: nobody else allocates from it. Event loop thread only.
    """

    def __init__(self, pages: ExtentAllocator):
        if pages.num_allocated:
            raise InvalidArgument("SlabAllocator needs an empty page allocator")
        self._pages = pages
        self._page = pages.alignment
        self._slots = {c: self.slab_bytes(c) // c for c in SIZE_CLASSES}  # slots a slab of the class holds
        if max(self._slots.values()) > MAX_SLOTS:
            raise InvalidArgument(f"slabs over pages of {self._page} bytes would hold more than {MAX_SLOTS} slots")
        self._full = {c: (1 << n) - 1 for c, n in self._slots.items()}  # the mask of an empty slab
        self._slab_on = self._page_map()  # per page, 1 + the number of the slab on it (0: none)
        self._offset, self._class, self._free = array("q"), array("i"), array("Q")  # per slab number
        self._spare = array("i")  # slab numbers of slabs given back, taken first
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
            return self._slab_at(extent.offset) < 0 and self._pages.is_allocated(extent)
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
        s = self._slab_at(partial[0]) if partial else self._new_slab(c)
        if s is None:
            return None
        free = self._free[s]
        i = (free & -free).bit_length() - 1  # the lowest free slot
        self._free[s] = free = free & (free - 1)
        if not free:
            del partial[0]  # the lowest-offset partial slab is the one just used
        self._num_slots += 1
        self._slot_bytes += c
        return Extent(self._offset[s] + i * c, c)

    def alloc_many(self, size_bytes: int, count: int) -> list[Extent]:
        """Up to `count` extents of size_bytes, as many allocs would hand them out (slots
        taken a slab at a time); fewer (maybe none) when there is no more room."""
        c = self._class_of(size_bytes)
        if c is None:
            return self._pages.alloc_many(size_bytes, count)
        extents, partial = [], self._partial[c]
        while len(extents) < count:
            s = self._slab_at(partial[0]) if partial else self._new_slab(c)
            if s is None:
                break
            free, offset = self._free[s], self._offset[s]
            while free and len(extents) < count:
                extents.append(Extent(offset + ((free & -free).bit_length() - 1) * c, c))
                free &= free - 1
            self._free[s] = free
            if not free:
                del partial[0]
        self._num_slots += len(extents)
        self._slot_bytes += len(extents) * c
        return extents

    def trim_front(self, extent: Extent, nbytes: int) -> Extent:
        """Give back the first `nbytes` (whole pages) of a page extent alloc handed out; the
        rest stays allocated and is returned (ExtentAllocator.trim_front). Not for slots."""
        if not isinstance(extent, Extent) or extent.length < self._page or self._slab_at(extent.offset) >= 0:
            raise InvalidArgument(f"trim_front({extent!r}): only a page extent alloc handed out can be trimmed")
        return self._pages.trim_front(extent, nbytes)

    def free(self, extent: Extent) -> None:
        """Return an extent alloc handed out. Anything else (double free, a changed length,
        an extent of another allocator) raises InvalidArgument and changes nothing."""
        if not isinstance(extent, Extent):
            raise InvalidArgument(f"free({extent!r}): not an Extent")
        if extent.length >= self._page:
            if self._slab_at(extent.offset) >= 0:  # a slab's own pages: not handed out
                raise InvalidArgument(f"free({extent!r}): these pages hold a slab; free its slots")
            self._pages.free(extent)
            return
        found = self._slot_of(extent)
        if found is None:
            raise InvalidArgument(
                f"free({extent!r}): not a slot this allocator handed out "
                "(double free, wrong length, or never allocated)"
            )
        s, i = found
        c = extent.length
        was = self._free[s]
        self._free[s] = free = was | 1 << i
        self._num_slots -= 1
        self._slot_bytes -= c
        if free == self._full[c]:
            self._drop_slab(s)
        elif not was:
            insort(self._partial[c], self._offset[s])

    def compact(self) -> bool:
        """Housekeeping: the page allocator's maps rebuilt once frees left them mostly empty,
        and the slab columns started over once no slab is left. True if any was rebuilt."""
        rebuilt = not self._num_slabs and len(self._offset) > _MIN_COLUMNS
        if rebuilt:
            self._offset, self._class, self._free, self._spare = array("q"), array("i"), array("Q"), array("i")
            self._slab_on = self._page_map()  # (the pages slabs wrote to go back with the old one)
        return self._pages.compact() or rebuilt

    # -- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError describing the first broken invariant. O(pages + slabs)."""
        self._pages.check_integrity()
        spare = set(self._spare)
        partial = {o for offsets in self._partial.values() for o in offsets}
        num_slots = slot_bytes = slab_bytes = num_slabs = 0
        slab_on = np.frombuffer(self._slab_on, np.int32)
        pages_held = np.zeros_like(slab_on)
        for s in range(len(self._offset)):
            if s in spare:
                continue
            c, offset, free = self._class[s], self._offset[s], self._free[s]
            where = f"slab {s} at {offset} (class {c})"
            if c not in self._partial:
                raise RuntimeError(f"{where}: not a size class")
            length = self.slab_bytes(c)
            if not self._pages.is_allocated(Extent(offset, length)):
                raise RuntimeError(f"{where}: its pages are not allocated in the page allocator")
            first = offset // self._page
            if (slab_on[first:first + length // self._page] != s + 1).any():
                raise RuntimeError(f"{where}: a page of it maps to another slab")
            pages_held[first:first + length // self._page] = s + 1
            if free & ~self._full[c]:
                raise RuntimeError(f"{where}: free slots past its last")
            if free == self._full[c]:
                raise RuntimeError(f"{where}: empty but not given back")
            if bool(free) != (offset in partial):
                raise RuntimeError(f"{where}: listed as partial {offset in partial}, "
                                   f"has {free.bit_count()} free slots")
            taken = self._slots[c] - free.bit_count()
            num_slabs += 1
            num_slots += taken
            slot_bytes += taken * c
            slab_bytes += length
        if (pages_held != slab_on).any():
            raise RuntimeError("page -> slab map holds pages of no slab")
        for c, offsets in self._partial.items():
            listed = [self._slab_at(o) for o in offsets]
            if offsets != sorted(set(offsets)) or any(s < 0 or self._class[s] != c for s in listed):
                raise RuntimeError(f"partial slabs of class {c} unsorted, repeated, gone, or of another class")
        counted = (num_slabs, slab_bytes, num_slots, slot_bytes)
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

    def _page_map(self) -> memoryview:
        """An int32 per page of the arena, all 0: a private anonymous mapping, so its pages are
        memory only once a slab is on one of theirs; read an int at a time (a memoryview's
        item costs a quarter of a numpy array's)."""
        pages = self._pages.capacity_bytes // self._page
        return memoryview(mmap.mmap(-1, 4 * pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)).cast("i")

    def _slab_at(self, offset: int) -> int:
        """The number of the slab on the page holding `offset`, or -1 (none)."""
        page = offset // self._page
        return self._slab_on[page] - 1 if page < len(self._slab_on) else -1

    def _slot_of(self, extent: Extent) -> tuple[int, int] | None:
        """(slab number, slot index) of a taken slot that is exactly `extent`, else None."""
        s = self._slab_at(extent.offset)
        c = extent.length
        if s < 0 or c != self._class[s]:
            return None
        i, rest = divmod(extent.offset - self._offset[s], c)
        if rest or not 0 <= i < self._slots[c] or self._free[s] >> i & 1:
            return None
        return s, i

    def _new_slab(self, c: int) -> int | None:
        pages = self._pages.alloc(self.slab_bytes(c))
        if pages is None:
            return None
        if self._spare:
            s = self._spare.pop()
            self._offset[s], self._class[s], self._free[s] = pages.offset, c, self._full[c]
        else:
            s = len(self._offset)
            self._offset.append(pages.offset)
            self._class.append(c)
            self._free.append(self._full[c])
        first, count = pages.offset // self._page, pages.length // self._page
        self._slab_on[first:first + count] = array("i", (s + 1,)) * count
        insort(self._partial[c], pages.offset)
        self._num_slabs += 1
        self._slab_bytes += pages.length
        return s

    def _drop_slab(self, s: int) -> None:
        """An emptied slab: its pages go back to the page allocator, its number to the spares."""
        c, offset = self._class[s], self._offset[s]
        length = self.slab_bytes(c)
        partial = self._partial[c]
        i = bisect_left(partial, offset)
        if i < len(partial) and partial[i] == offset:
            del partial[i]
        first, count = offset // self._page, length // self._page
        self._slab_on[first:first + count] = array("i", (0,)) * count
        self._pages.free(Extent(offset, length))
        self._spare.append(s)
        self._num_slabs -= 1
        self._slab_bytes -= length
