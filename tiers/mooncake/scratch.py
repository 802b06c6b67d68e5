"""Header slots: registered memory the pool headers of a batch are written from and read
into (the payloads move straight from and into tier memory; only headers pass here)."""

from __future__ import annotations

import asyncio

import numpy as np

from kvstore.pool_header import HEADER_BYTES

# 256 headers in flight (1 MiB): four full batches of puts or lookups at once; more wait.
HEADER_SLOTS = 256


class HeaderSlots:
    """`HEADER_SLOTS` buffers of HEADER_BYTES in one array. Loop thread only."""

    def __init__(self, count: int = HEADER_SLOTS):
        self.buffer = np.zeros(count * HEADER_BYTES, dtype=np.uint8)
        self.address = self.buffer.ctypes.data
        self._free = list(range(count))
        self._freed = asyncio.Condition()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    async def take(self, n: int) -> list[int]:
        """n slots (n <= HEADER_SLOTS), waiting for others to give theirs back."""
        async with self._freed:
            await self._freed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    async def give(self, slots: list[int]) -> None:
        async with self._freed:
            self._free += slots
            self._freed.notify_all()

    def offset(self, slot: int) -> int:
        return slot * HEADER_BYTES

    def view(self, slot: int) -> memoryview:
        return memoryview(self.buffer)[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES]
