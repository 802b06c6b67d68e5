"""First-fit extent allocator over one address range (an arena, a data file).

    alloc(n):  round n up to the alignment; take the free extent with the lowest offset whose
               length fits; carve the request off its front; the rest stays free.
    free(e):   e must be exactly an extent alloc returned and not yet freed; merge it with
               the free extents that touch it on either side, so free space never fragments
               into neighbours.

Lowest address first keeps allocations packed at the bottom of the range, so the memory that
was used recently (and is therefore faulted in and warm) is what gets reused.

Free extents live in three structures: a sorted list of offsets (neighbours for coalescing),
a dict offset -> length, and per size class (lengths in [2^k, 2^(k+1)) alignment units) a
sorted list of offsets. Any extent of a larger class fits, so its lowest offset is a candidate
in O(1); only the request's own class is scanned, in address order, and only up to the best
candidate from the larger classes. The allocator holds no memory, only numbers.

Not thread-safe: the daemon's event loop thread is the only caller.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.policy.base import outgrown
from kvstore.tiers.initial_extents import InitialExtents

# How many too-small holes of the request's own size class alloc looks at before it settles for
# a hole of a larger class (still lowest-offset among those). Bounds alloc's time on a badly
# fragmented range; if no larger hole exists the scan goes on, so alloc never misses a fit.
_MAX_CLASS_SCAN = 64


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range [offset, offset + length) of one address range."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        # One expression (made for every put, get and free: a loop over the fields cost 0.45 us).
        offset, length = self.offset, self.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0:
            for name, value in (("offset", offset), ("length", length)):
                if type(value) is not int:
                    raise InvalidArgument(f"Extent.{name} must be an int, got {value!r}")
            raise InvalidArgument(f"Extent needs offset >= 0 and length > 0, got ({offset}, {length})")

    @property
    def end(self) -> int:
        return self.offset + self.length


class ExtentAllocator:
    """Hands out aligned extents of [0, capacity_bytes). Event loop thread only."""

    def __init__(self, capacity_bytes: int, alignment: int = 4096,
                 allocated: tuple[Sequence[int], Sequence[int]] | None = None):
        """allocated: (offsets, lengths) of extents taken from the start, sorted by offset,
        aligned and disjoint (what NVMe recovery rebuilds from its index; int64 numpy arrays
        are kept, not copied: the caller must not change them). Replaying allocs would cost
        4.4 us each (4.4 s for a million objects), so the holes between are found with numpy
        and filled directly, and the extents stay in those arrays (initial_extents.py)."""
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment!r}")
        if type(capacity_bytes) is not int or capacity_bytes <= 0 or capacity_bytes % alignment:
            raise InvalidArgument(
                f"capacity_bytes must be a positive multiple of {alignment}, got {capacity_bytes!r}"
            )
        self._capacity = capacity_bytes
        self._alignment = alignment
        self._free_offsets: list[int] = []
        self._free: dict[int, int] = {}
        self._by_class: list[list[int]] = [[] for _ in range(self._class_of(capacity_bytes) + 1)]
        self._allocated: dict[int, int] = {}  # what alloc handed out (recovered ones: _initial)
        offsets, lengths = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (allocated or ((), ())))
        self._check_initial(offsets, lengths)
        self._initial = InitialExtents(offsets, lengths)
        self._used = self._initial.total_bytes
        self._fill_holes(offsets, lengths)

    # -- queries ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def num_allocated(self) -> int:
        return len(self._allocated) + len(self._initial)

    @property
    def num_free_extents(self) -> int:
        return len(self._free_offsets)

    @property
    def largest_free_bytes(self) -> int:
        """The largest single extent alloc could return now (0 when full)."""
        for offsets in reversed(self._by_class):
            if offsets:
                return max(self._free[o] for o in offsets)
        return 0

    def is_allocated(self, extent: Extent) -> bool:
        length = self._allocated.get(extent.offset)
        if length is None:
            length = self._initial.get(extent.offset)
        return length == extent.length

    def can_alloc(self, size_bytes: int) -> bool:
        """True when alloc(size_bytes) would succeed now. Same validation as alloc."""
        return self._find(self._rounded(size_bytes)) is not None

    # -- changes ------------------------------------------------------------------------------

    def alloc(self, size_bytes: int) -> Extent | None:
        """An extent of at least size_bytes (rounded up to the alignment), or None when no
        contiguous free extent is that large. size_bytes <= 0 raises InvalidArgument."""
        length = self._rounded(size_bytes)
        offset = self._find(length)
        if offset is None:
            return None
        hole = self._free[offset]
        self._remove_free(offset)
        if hole > length:
            self._add_free(offset + length, hole - length)
        self._allocated[offset] = length
        self._used += length
        return Extent(offset, length)

    def alloc_many(self, size_bytes: int, count: int) -> list[Extent]:
        """Up to `count` extents of size_bytes, as many allocs would hand them out: each hole
        alloc would choose is carved into as many as it holds at once. Fewer (maybe none)
        when the free space runs out."""
        length, extents = self._rounded(size_bytes), []
        while len(extents) < count and (offset := self._find(length)) is not None:
            hole = self._free[offset]
            taken = min(count - len(extents), hole // length)
            self._remove_free(offset)
            if hole > taken * length:
                self._add_free(offset + taken * length, hole - taken * length)
            starts = range(offset, offset + taken * length, length)
            self._allocated.update(dict.fromkeys(starts, length))
            extents += [Extent(start, length) for start in starts]
        self._used += len(extents) * length
        return extents

    def free(self, extent: Extent) -> None:
        """Return an extent that alloc handed out. Anything else (double free, a changed
        length, an extent of another allocator) raises InvalidArgument and changes nothing."""
        if not isinstance(extent, Extent) or not self.is_allocated(extent):
            raise InvalidArgument(
                f"free({extent!r}): not an allocated extent of this allocator "
                "(double free, wrong length, or never allocated)"
            )
        offset, length = extent.offset, extent.length
        if self._allocated.pop(offset, None) is None:
            self._initial.remove(offset)
        self._used -= length
        i = bisect_left(self._free_offsets, offset)
        right = offset + length
        if i < len(self._free_offsets) and self._free_offsets[i] == right:
            length += self._free[right]
            self._remove_free(right)
        if i > 0:
            left = self._free_offsets[i - 1]
            if left + self._free[left] == offset:
                length += self._free[left]
                offset = left
                self._remove_free(left)
        self._add_free(offset, length)

    def trim_front(self, extent: Extent, nbytes: int) -> Extent:
        """Give back the first `nbytes` of an extent alloc handed out (a multiple of the
        alignment, shorter than the extent) and keep the rest allocated: the extent returned,
        which free takes from then on (a reader that fetched a header in front of the bytes it
        keeps). Anything else raises InvalidArgument and changes nothing."""
        if (not isinstance(extent, Extent) or self._allocated.get(extent.offset) != extent.length
                or type(nbytes) is not int or nbytes <= 0 or nbytes % self._alignment or nbytes >= extent.length):
            raise InvalidArgument(
                f"trim_front({extent!r}, {nbytes!r}): needs an extent alloc handed out and a positive "
                f"multiple of {self._alignment} shorter than it"
            )
        kept = Extent(extent.offset + nbytes, extent.length - nbytes)
        self._allocated[extent.offset] = nbytes
        self._allocated[kept.offset] = kept.length
        self.free(Extent(extent.offset, nbytes))
        return kept

    def compact(self) -> bool:
        """Housekeeping: rebuild the maps that frees left mostly empty (a dict keeps the table
        of its peak: a million extents freed would keep ~40 MB). True if any was rebuilt."""
        rebuilt = False
        if outgrown(self._allocated):
            self._allocated, rebuilt = dict(self._allocated), True
        if outgrown(self._free):
            self._free, rebuilt = dict(self._free), True
        return rebuilt

    # -- integrity ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError describing the first broken invariant. O(n log n)."""
        if sorted(self._free) != self._free_offsets:
            raise RuntimeError("free offsets list is unsorted or disagrees with the free map")
        prev_end = -1
        for offset in self._free_offsets:
            length = self._free[offset]
            if length <= 0 or offset % self._alignment or length % self._alignment:
                raise RuntimeError(f"free extent ({offset}, {length}) is empty or unaligned")
            if offset < prev_end:
                raise RuntimeError(f"free extent at {offset} overlaps the one ending at {prev_end}")
            if offset == prev_end:
                raise RuntimeError(f"free extents meet at {offset} but were not coalesced")
            prev_end = offset + length
        for k, offsets in enumerate(self._by_class):
            if offsets != sorted(offsets) or any(self._class_of(self._free[o]) != k for o in offsets):
                raise RuntimeError(f"size class {k} index is unsorted or holds a wrong extent")
        if sum(map(len, self._by_class)) != len(self._free):
            raise RuntimeError("size class index and free map hold different extents")
        allocated = [*self._allocated.items(), *self._initial.items()]
        if sum(length for _, length in allocated) != self._used:
            raise RuntimeError(f"used_bytes {self._used} != sum of allocated extents")
        spans = sorted([*self._free.items(), *allocated])
        position = 0
        for offset, length in spans:
            if offset != position:
                kind = "overlap" if offset < position else "gap (lost bytes)"
                raise RuntimeError(f"extents {kind} at offset {min(offset, position)}")
            position = offset + length
        if position != self._capacity or self._used + sum(self._free.values()) != self._capacity:
            raise RuntimeError(
                f"used {self._used} + free {sum(self._free.values())} != capacity {self._capacity}"
            )

    # -- internals ----------------------------------------------------------------------------

    def _check_initial(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        if len(offsets) != len(lengths):
            raise InvalidArgument(f"allocated: {len(offsets)} offsets but {len(lengths)} lengths")
        ends = offsets + lengths
        if len(offsets) and not (
            offsets[0] >= 0 and ends[-1] <= self._capacity and (lengths > 0).all()
            and not ((offsets | lengths) & (self._alignment - 1)).any() and (offsets[1:] >= ends[:-1]).all()
        ):
            raise InvalidArgument("allocated extents must be aligned, sorted, disjoint and inside the range")

    def _fill_holes(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Make every gap between the allocated extents (sorted, disjoint) a free extent."""
        starts = np.concatenate(([0], offsets + lengths))
        sizes = np.concatenate((offsets, [self._capacity])) - starts
        holes = np.nonzero(sizes)[0]
        starts, sizes = starts[holes], sizes[holes]
        self._free_offsets = starts.tolist()
        self._free = dict(zip(self._free_offsets, sizes.tolist()))
        classes = np.frexp((sizes // self._alignment).astype(np.float64))[1] - 1  # exact: < 2**53
        order = np.argsort(classes, kind="stable")  # offset order within each class
        bounds = np.searchsorted(classes[order], np.arange(len(self._by_class) + 1)).tolist()
        ordered = starts[order].tolist()
        self._by_class = [ordered[bounds[k] : bounds[k + 1]] for k in range(len(self._by_class))]

    def _rounded(self, size_bytes: int) -> int:
        if type(size_bytes) is not int or size_bytes <= 0:
            raise InvalidArgument(f"size_bytes must be a positive int, got {size_bytes!r}")
        return -(-size_bytes // self._alignment) * self._alignment

    def _class_of(self, length: int) -> int:
        return (length // self._alignment).bit_length() - 1

    def _find(self, length: int) -> int | None:
        """Offset of the lowest free extent that fits `length`, or None."""
        k = self._class_of(length)
        if k >= len(self._by_class):
            return None
        best = None
        for offsets in self._by_class[k + 1 :]:
            if offsets and (best is None or offsets[0] < best):
                best = offsets[0]
        for scanned, offset in enumerate(self._by_class[k]):
            if best is not None and (offset > best or scanned >= _MAX_CLASS_SCAN):
                break
            if self._free[offset] >= length:
                return offset
        return best

    def _add_free(self, offset: int, length: int) -> None:
        insort(self._free_offsets, offset)
        self._free[offset] = length
        insort(self._by_class[self._class_of(length)], offset)

    def _remove_free(self, offset: int) -> None:
        length = self._free.pop(offset)
        del self._free_offsets[bisect_left(self._free_offsets, offset)]
        offsets = self._by_class[self._class_of(length)]
        del offsets[bisect_left(offsets, offset)]
