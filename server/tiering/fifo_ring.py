"""A FIFO of integers in one growable numpy buffer: the S and M queues of row numbers
(int32, server/tiering/nvme_table.py) and of row places (int64, server/tiering/row_policy.py).
4 or 8 B a place, where a deque of Python ints costs ~40."""

from __future__ import annotations

import numpy as np


class Ring:
    """Rows oldest (the tail) first: `append` at the head, `popleft` at the tail, and
    `push_tail` to put popped rows back where they were, in their order."""

    def __init__(self, rows=(), dtype=np.int32):
        self.dtype = dtype
        self.replace(np.asarray(rows, dtype))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, row: int) -> None:
        if self._len == len(self._buf):
            self._resize(2 * len(self._buf))
        self._buf[(self._start + self._len) % len(self._buf)] = row
        self._len += 1

    def popleft(self) -> int:
        if not self._len:
            raise IndexError("pop from an empty ring")
        row = int(self._buf[self._start])
        self._start = (self._start + 1) % len(self._buf)
        self._len -= 1
        return row

    def extend(self, rows: np.ndarray) -> None:
        """Append every row of `rows`, in order."""
        self._make_room(len(rows))
        self._buf[(self._start + self._len + np.arange(len(rows))) % len(self._buf)] = rows
        self._len += len(rows)

    def push_tail(self, rows: list[int]) -> None:
        """Put rows back at the tail: rows[0] becomes the oldest."""
        if not rows:
            return
        self._make_room(len(rows))
        self._start = (self._start - len(rows)) % len(self._buf)
        self._buf[(self._start + np.arange(len(rows))) % len(self._buf)] = rows
        self._len += len(rows)

    def items(self) -> np.ndarray:
        """The rows, oldest first (a copy)."""
        return self._buf[(self._start + np.arange(self._len)) % len(self._buf)]

    def shrink(self) -> bool:
        """Give back a buffer mostly empty (a FIFO that drained never shrinks by itself)."""
        if len(self._buf) <= max(64, 4 * self._len):
            return False
        self.replace(self.items())
        return True

    def replace(self, rows: np.ndarray) -> None:
        """Hold exactly `rows` (oldest first), in a buffer sized for them."""
        self._buf = np.empty(max(16, 2 * len(rows)), self.dtype)
        self._buf[:len(rows)] = rows
        self._start, self._len = 0, len(rows)

    def _make_room(self, more: int) -> None:
        if self._len + more > len(self._buf):
            self._resize(max(2 * len(self._buf), 2 * (self._len + more)))

    def _resize(self, size: int) -> None:
        rows = self.items()
        self._buf = np.empty(size, self.dtype)
        self._buf[:len(rows)] = rows
        self._start = 0
