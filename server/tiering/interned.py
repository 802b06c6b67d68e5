"""Values that many rows of a table share, each kept once: a row holds a small index.

An object table's rows carry a descriptor and hints (server/tiering/object_table.py). A
model's chunks share a handful of descriptors and usually one set of hints, so a reference
per row (8 B, and a list's slack) bought nothing: each distinct (descriptor, hints) pair is
kept here once, and a row keeps its index in a uint16 column (2 B; the table widens it to
uint32 past 65,536 values).

An index is counted per row that refers to it and reused once none does, so values that
come and go (an agent session's hints) do not pile up.

The event loop's thread only, like the tables that use it.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable

import numpy as np


class Interned:
    """Distinct hashable values, each at an index rows refer to (`ref`, `unref`)."""

    def __init__(self):
        self.values: list = []  # by index; None: a free index
        self._index: dict = {}
        self._refs = array("q")
        self._free = array("l")

    def __len__(self) -> int:  # distinct values referred to
        return len(self._index)

    def ref(self, value: Hashable, count: int = 1) -> int:
        """The index of `value` (added if new), counted `count` times more."""
        i = self._index.get(value)
        if i is None:
            if self._free:
                i = self._free.pop()
                self.values[i] = value
            else:
                i = len(self.values)
                self.values.append(value)
                self._refs.append(0)
            self._index[value] = i
        self._refs[i] += count
        return i

    def unref(self, i: int) -> None:
        """A row no longer refers to index `i`; the last one frees it."""
        self._refs[i] -= 1
        if not self._refs[i]:
            del self._index[self.values[i]]
            self.values[i] = None
            self._free.append(i)

    def recount(self, indices: np.ndarray) -> None:
        """The rows now refer to exactly `indices` (a table kept some of its rows): the
        counts start again from them, and indices no row keeps are freed."""
        self._refs = array("q", np.bincount(indices, minlength=len(self.values)).tolist())
        for i, (value, count) in enumerate(zip(self.values, self._refs)):
            if value is not None and not count:
                del self._index[value]
                self.values[i] = None
        self._free = array("l", [i for i, value in enumerate(self.values) if value is None])

    def check_integrity(self, indices: np.ndarray) -> None:
        """Raise RuntimeError unless the counts are exactly the rows' references `indices`."""
        if np.bincount(indices, minlength=len(self.values)).tolist() != self._refs.tolist():
            raise RuntimeError("interned values: the counts differ from the rows' references")
        held = {i for i, value in enumerate(self.values) if value is not None}
        if held != set(self._index.values()) or held != {i for i, c in enumerate(self._refs) if c}:
            raise RuntimeError("interned values: the index and the counted values disagree")
