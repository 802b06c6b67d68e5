"""When NVMe objects put with a TTL expire: wall-clock deadlines by the NVMe table's key.

A TTL counts from the put, on every tier. The host tier keeps its own (ObjectEntry.expires_at,
server/tiering/expiry.py); an object written down to NVMe carries its deadline here, taken from
its put time (created_at) and hints.ttl_s, and a restart learns it again from the records
(tiers/nvme/holdings.py: deadlines_of). Wall clock, not monotonic: it must hold across restarts.
Only objects with a TTL are kept; past its deadline an object is a miss at once (`expired`) and
is deleted by housekeeping (`due`).
"""

from __future__ import annotations

import heapq


class NvmeDeadlines:
    def __init__(self):
        self._at: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._at)

    def add(self, key: bytes, deadline: float) -> None:
        self._at[key] = deadline
        heapq.heappush(self._heap, (deadline, key))

    def discard(self, key: bytes) -> None:
        self._at.pop(key, None)  # its heap item is skipped when popped

    def expired(self, key: bytes, now: float) -> bool:
        deadline = self._at.get(key)
        return deadline is not None and deadline <= now

    def due(self, now: float) -> list[bytes]:
        """Keys past their deadline at `now`, each once (and forgotten here)."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if self._at.get(key) == deadline:
                del self._at[key]
                out.append(key)
        if len(heap) > 4096 and len(heap) > 2 * len(self._at):  # mostly discarded items: rebuild
            self._heap = [(at, key) for key, at in self._at.items()]
            heapq.heapify(self._heap)
        return out

    def check_integrity(self, held) -> None:
        """Every key with a deadline is one NVMe holds (`held`: key -> bool)."""
        stray = [key for key in self._at if not held(key)]
        if stray:
            raise RuntimeError(f"{len(stray)} NVMe deadlines name objects NVMe does not hold, e.g. {stray[0]!r}")
