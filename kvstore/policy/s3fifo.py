"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

    insert(x):  if x in G: remove x from G; push x at M's head      # seen recently: skip probation
                else:      push x at S's head
    access(x):  x.freq = min(x.freq + 1, 3)                         # no queue movement on a hit
    evict():    if S.bytes >= 10% of capacity or M is empty: evict_S() else: evict_M()
    evict_S():  t = S.tail
                if t.freq >= 1: move t to M's head                 # re-used while on probation
                else:           push t's key at G's head; t is the victim   # one-hit wonder
    evict_M():  t = M.tail
                if t.freq > 0:  t.freq -= 1; move t to M's head    # a second chance, at most 3
                else:           t is the victim
    G holds keys only, FIFO, bounded by M's share of the capacity and a fixed entry count.
    A pinned or leased tail (evictable(t) is False) is stepped over and left exactly as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kvstore.policy.base import EvictionPolicy, PolicyEntry

# The paper's default: a 10% probation queue drops most one-hit wonders before they
# displace anything in M, yet is long enough for a real re-use to arrive in time.
SMALL_QUEUE_FRACTION = 0.10
# Saturating at 3 lets a hot object survive three trips through M, in 2 bits of state.
MAX_FREQ = 3
# Hits needed while in S to be promoted: "accessed at least once since insertion".
PROMOTE_MIN_FREQ = 1
# A ghost entry costs ~200 bytes of Python memory; this keeps the ghost near 50 MB even
# when objects are so small that the byte bound alone would allow millions of keys.
MAX_GHOST_ENTRIES = 1 << 18

Queue = OrderedDict  # oldest (tail) first, newest (head) last


@dataclass(slots=True)
class _Scan:
    """State of one victims() call: the caller's predicate and what it stepped over."""

    evictable: Callable[[Hashable], bool]
    skipped_small: list[tuple[Hashable, PolicyEntry]] = field(default_factory=list)
    skipped_main: list[tuple[Hashable, PolicyEntry]] = field(default_factory=list)


class S3FIFO(EvictionPolicy):
    """Three FIFOs: S (probation, 10% of bytes), M (main) and G (ghost keys of S's victims)."""

    name = "s3fifo"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self.small_target_bytes = max(1, int(capacity_bytes * SMALL_QUEUE_FRACTION))
        self.ghost_capacity_bytes = capacity_bytes - self.small_target_bytes
        self._small: Queue[Hashable, PolicyEntry] = OrderedDict()
        self._main: Queue[Hashable, PolicyEntry] = OrderedDict()
        self._ghost: Queue[Hashable, int] = OrderedDict()  # key -> size it had
        # Bytes of S and M include entries a victims() call has stepped over.
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0

    def on_insert(
        self, key: Hashable, size_bytes: int, recompute_cost: float | None = None, priority: int = 0
    ) -> None:
        entry = self._add_entry(key, size_bytes, recompute_cost, priority)
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = entry
            self._main_bytes += size_bytes
        else:
            self._small[key] = entry
            self._small_bytes += size_bytes

    def on_access(self, key: Hashable) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.freq < MAX_FREQ:
            entry.freq += 1

    def on_remove(self, key: Hashable) -> None:
        if key not in self._entries:
            return
        entry = self._drop_entry(key)
        if self._small.pop(key, None) is not None:
            self._small_bytes -= entry.size_bytes
        else:
            del self._main[key]
            self._main_bytes -= entry.size_bytes

    def victims(self, bytes_needed: int, evictable: Callable[[Hashable], bool]) -> list:
        if bytes_needed <= 0:
            return []
        scan = _Scan(evictable)
        chosen: list = []
        freed = 0
        try:
            # Ends: each pass evicts, or empties a queue for this call (skipped entries
            # stay out until the end; each key is promoted once and rotated <= MAX_FREQ times).
            while freed < bytes_needed:
                from_small = bool(self._small) and (
                    self._small_bytes >= self.small_target_bytes or not self._main
                )
                if not from_small and not self._main:
                    break
                picked = self._select(from_small, scan)
                if picked is None:
                    continue
                key, entry = picked
                self._evict(key, entry, from_small)
                chosen.append(key)
                freed += entry.size_bytes
        finally:
            self._push_tail(self._small, scan.skipped_small)
            self._push_tail(self._main, scan.skipped_main)
        return chosen

    def _select(self, from_small: bool, scan: _Scan) -> tuple[Hashable, PolicyEntry] | None:
        """Hook: the victim to take from S or M, already popped from it; None if it ran dry."""
        return self._next_candidate(from_small, scan)

    def _next_candidate(self, from_small: bool, scan: _Scan) -> tuple[Hashable, PolicyEntry] | None:
        """Run S3-FIFO from the queue's tail until an evictable, exhausted entry comes out."""
        queue = self._queue(from_small)
        while queue:
            key, entry = queue.popitem(last=False)
            if not scan.evictable(key):
                (scan.skipped_small if from_small else scan.skipped_main).append((key, entry))
            elif from_small and entry.freq >= PROMOTE_MIN_FREQ:
                self._small_bytes -= entry.size_bytes
                self._main[key] = entry
                self._main_bytes += entry.size_bytes
            elif not from_small and entry.freq > 0:
                entry.freq -= 1
                queue[key] = entry
            else:
                return key, entry
        return None

    def _rebuild_queues(self) -> None:
        self._small, self._main, self._ghost = OrderedDict(self._small), OrderedDict(self._main), OrderedDict(self._ghost)

    def _queue(self, small: bool) -> Queue[Hashable, PolicyEntry]:
        return self._small if small else self._main

    @staticmethod
    def _push_tail(queue: Queue, items: list[tuple[Hashable, PolicyEntry]]) -> None:
        """Put popped entries back at the tail, oldest first, in their original order."""
        for key, entry in reversed(items):
            queue[key] = entry
            queue.move_to_end(key, last=False)

    def _evict(self, key: Hashable, entry: PolicyEntry, from_small: bool) -> None:
        self._drop_entry(key)
        if not from_small:
            self._main_bytes -= entry.size_bytes
            return
        self._small_bytes -= entry.size_bytes
        self._ghost[key] = entry.size_bytes  # never already there: ghost keys are untracked
        self._ghost_bytes += entry.size_bytes
        while self._ghost and (
            self._ghost_bytes > self.ghost_capacity_bytes or len(self._ghost) > MAX_GHOST_ENTRIES
        ):
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def _check_structure(self) -> None:
        if self._small.keys() & self._main.keys():
            raise self._integrity_error("a key is in both S and M")
        if len(self._small) + len(self._main) != len(self._entries):
            raise self._integrity_error(
                f"S and M hold {len(self._small) + len(self._main)} keys, {len(self._entries)} are tracked"
            )
        for name, queue, recorded in (("S", self._small, self._small_bytes), ("M", self._main, self._main_bytes)):
            total = 0
            for key, entry in queue.items():
                if self._entries.get(key) is not entry:
                    raise self._integrity_error(f"{name} holds {key!r} but its entry is not the tracked one")
                if not 0 <= entry.freq <= MAX_FREQ:
                    raise self._integrity_error(f"{key!r} has freq {entry.freq}")
                total += entry.size_bytes
            if total != recorded:
                raise self._integrity_error(f"{name} records {recorded} bytes, holds {total}")
        if self._ghost.keys() & self._entries.keys():
            raise self._integrity_error("a tracked key is also in the ghost queue")
        if sum(self._ghost.values()) != self._ghost_bytes:
            raise self._integrity_error(f"ghost records {self._ghost_bytes} bytes, holds {sum(self._ghost.values())}")
        if self._ghost_bytes > self.ghost_capacity_bytes or len(self._ghost) > MAX_GHOST_ENTRIES:
            raise self._integrity_error(
                f"ghost holds {len(self._ghost)} keys / {self._ghost_bytes} bytes, over its bound"
            )
