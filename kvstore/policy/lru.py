"""Least-recently-used eviction: the baseline the S3-FIFO policies are measured against.

    insert(x):  push x at the MRU end
    access(x):  move x to the MRU end
    evict():    walk from the LRU end; step over t if not evictable(t), else t is the victim
    Stepped-over keys keep their place: they are still least recent once unpinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvstore.policy.base import EvictionPolicy, size_of


class LRU(EvictionPolicy):
    """One recency list: least recently inserted or accessed goes first."""

    name = "lru"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # LRU first, MRU last

    def _rebuild_queues(self) -> None:
        self._order = OrderedDict(self._order)

    def on_insert(
        self, key: Hashable, size_bytes: int, recompute_cost: float | None = None, priority: int = 0
    ) -> None:
        self._add_entry(key, size_bytes, recompute_cost, priority)
        self._order[key] = None

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        if key in self._entries:
            self._drop_entry(key)
            del self._order[key]

    def victims(self, bytes_needed: int, evictable: Callable[[Hashable], bool]) -> list:
        if bytes_needed <= 0:
            return []
        chosen: list = []
        skipped: list = []
        freed = 0
        try:
            while freed < bytes_needed and self._order:
                key, _ = self._order.popitem(last=False)
                if evictable(key):
                    freed += size_of(self._drop_entry(key))
                    chosen.append(key)
                else:
                    skipped.append(key)
        finally:
            for key in reversed(skipped):
                self._order[key] = None
                self._order.move_to_end(key, last=False)
        return chosen

    def _check_structure(self) -> None:
        if self._order.keys() != self._entries.keys():
            raise self._integrity_error("the recency list and the tracked keys differ")
