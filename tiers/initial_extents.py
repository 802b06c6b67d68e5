"""The extents an ExtentAllocator starts with allocated (NVMe recovery's, from its index),
kept as the two sorted numpy arrays recovery built instead of a dict of 10 M Python ints.

    get(offset)     the length allocated there, or None: a binary search, unless removed
    remove(offset)  the extent is freed: remembered in a set; once the set holds half the
                    arrays, both are rebuilt without the freed ones (so memory shrinks)
    items()         the ones still allocated, as (offset, length) pairs in offset order

Only removal: what the allocator hands out later lives in its own dict, which it checks
first, so an offset freed here and allocated again is answered from there. Building the
dict at startup cost 0.3 s per million extents, more than the rest of the allocator's
construction (tests/tiers/test_allocator.py checks both give the same answers).

Not thread-safe, like its allocator.
"""

from __future__ import annotations

import numpy as np


class InitialExtents:
    def __init__(self, offsets: np.ndarray, lengths: np.ndarray):
        """offsets: sorted, distinct (int64 arrays of equal length; the caller checked)."""
        self._offsets, self._lengths = offsets, lengths
        self._removed: set[int] = set()
        self._bytes = int(lengths.sum())

    def __len__(self) -> int:
        return len(self._offsets) - len(self._removed)

    @property
    def total_bytes(self) -> int:
        """Sum of the lengths still allocated."""
        return self._bytes

    def get(self, offset: int) -> int | None:
        if not len(self._offsets) or offset in self._removed:
            return None
        i = int(np.searchsorted(self._offsets, offset))
        if i < len(self._offsets) and self._offsets[i] == offset:
            return int(self._lengths[i])
        return None

    def remove(self, offset: int) -> None:
        """offset must be one get answers for (the allocator checks first)."""
        self._bytes -= self.get(offset)
        self._removed.add(offset)
        if 2 * len(self._removed) > len(self._offsets):
            keep = ~np.isin(self._offsets, np.fromiter(self._removed, np.int64, len(self._removed)))
            self._offsets, self._lengths = self._offsets[keep], self._lengths[keep]
            self._removed = set()

    def items(self) -> list[tuple[int, int]]:
        return [(o, n) for o, n in zip(self._offsets.tolist(), self._lengths.tolist()) if o not in self._removed]
