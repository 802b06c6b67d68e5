"""When objects with a TTL expire: a heap by expiry time, so housekeeping touches only what is due.

Housekeeping used to scan every object every second (a million objects: ~0.1 s of the event
loop each second) to find the few past their TTL. Now each object put with `hints.ttl_s`
is pushed here once; `due(now)` pops what is past its time. Removals do not reach into the
heap: a popped item whose object left meanwhile (deleted, evicted, replaced by a new copy:
another serial) is skipped, and `rebuild` drops such stale items once they are most of it.
Objects without a TTL cost nothing here.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Iterator

from kvstore.identity import ObjectId
from kvstore.server.tiering.objects import ObjectEntry

# Rebuild once the heap holds this many items and more than twice the live ones.
REBUILD_MIN_ITEMS = 4096


class ExpiryQueue:
    def __init__(self):
        self._heap: list[tuple[float, int, str, ObjectId]] = []  # (expires_at, serial, namespace, id)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, entry: ObjectEntry) -> None:
        if entry.expires_at != math.inf:
            heapq.heappush(self._heap, (entry.expires_at, entry.serial, entry.namespace, entry.object_id))

    def due(self, now: float) -> Iterator[tuple[str, ObjectId, int]]:
        """(namespace, id, serial) of each item past its time, popped; the caller checks that
        the object it finds is still that copy (same serial)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, serial, namespace, oid = heapq.heappop(heap)
            yield namespace, oid, serial

    def rebuild_if_stale(self, live: Iterable[ObjectEntry], num_live: int) -> bool:
        """Drop items whose objects left, once they are most of the heap. `live`: every
        indexed entry (read only when rebuilding); num_live: how many there are."""
        if len(self._heap) < REBUILD_MIN_ITEMS or len(self._heap) <= 2 * num_live:
            return False
        self._heap = [(e.expires_at, e.serial, e.namespace, e.object_id) for e in live if e.expires_at != math.inf]
        heapq.heapify(self._heap)
        return True
