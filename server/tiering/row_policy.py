"""A namespace's eviction policy over the rows of its ObjectTable (server/tiering/object_table.py):
S3-FIFO, cost-aware S3-FIFO and LRU, with each object's state in columns.

kvstore/policy/ holds the same algorithms over hashable keys: the reference, and what the
tests compare these with, victim for victim. Kept per key (a dict entry, the id it keeps
alive, a deque place) they cost the host index ~130 B an object; here an object costs 5 B
of columns and a queue place:

    state[row]  uint8   TRACKED; IN_MAIN (S3-FIFO's main queue); freq (hits not yet spent, 0..3)
    gen[row]    uint32  (31 bits) bumped whenever the row is queued anew (an insert; for LRU a hit too)
    S, M        int64   FIFO rings of places, row | gen << 32 (server/tiering/fifo_ring.py).
                        A place is live while its row is tracked, in that queue, with that
                        gen; any other place is stale: the queue steps over it when it
                        reaches it, and drops every stale place (vectorised) once they
                        outnumber the tracked rows, exactly when the reference does
    ghost       kvstore.policy.s3fifo.Ghost: hash of an evicted id (table.m_hash) -> its size; bounded

Size, priority and recompute cost are read from the row itself (table.m_size,
table.hints_at(row)); nothing is copied. A row's gen outlives the object on it, so a place an
earlier object left is stale for the next one; when the table compacts (moves its rows) it
calls `renumber`. Keys at the interface are row numbers; `evictable(row)` is the tier's.
The event loop's thread only, like the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.policy.base import (
    COMPACT_MIN_KEYS,
    FREQ_MASK,
    IN_MAIN,
    MIN_PRIORITY,
    PRIORITY_SHIFT,
    SIZE_SHIFT,
    sparse,
)
from kvstore.policy.cost_aware import CANDIDATE_WINDOW, score
from kvstore.policy.s3fifo import EVICT, MAX_FREQ, PROMOTE, SMALL_QUEUE_FRACTION, Ghost, tail_step
from kvstore.server.tiering.fifo_ring import Ring

TRACKED = 1 << 3
ROW_MASK = (1 << 32) - 1
GEN_SHIFT = 32
# 31 bits keep a place a positive int64. A gen comes round again only after 2**31 bumps of
# its row, and the stale places are dropped (every place left is live) long before that.
GEN_MASK = (1 << 31) - 1
MIN_ROWS = 64


@dataclass(slots=True)
class _Scan:
    """One victims() call: the tier's predicate and the places it stepped over."""

    evictable: Callable[[int], bool]
    skipped_small: list[int] = field(default_factory=list)
    skipped_main: list[int] = field(default_factory=list)


class RowPolicy:
    """What every row policy shares: the columns, tracking, and the stale-place rule."""

    name: str

    def __init__(self, table, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.table = table
        self.capacity_bytes = capacity_bytes
        self._tracked = 0
        self._tracked_bytes = 0
        self._columns(MIN_ROWS, 0)

    def _columns(self, rows: int, keep: int) -> None:
        state, gen = np.zeros(rows, np.uint8), np.zeros(rows, np.uint32)
        if keep:
            state[:keep], gen[:keep] = self.c_state[:keep], self.c_gen[:keep]
        self.c_state, self.c_gen = state, gen
        self.m_state, self.m_gen = memoryview(state), memoryview(gen)

    def _queues(self) -> tuple[tuple[Ring, int], ...]:
        """Each ring with the IN_MAIN bit its live rows have."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self._tracked

    def __contains__(self, row: object) -> bool:
        return isinstance(row, int) and 0 <= row < len(self.m_state) and bool(self.m_state[row] & TRACKED)

    @property
    def tracked_bytes(self) -> int:
        return self._tracked_bytes

    def rows(self) -> np.ndarray:
        """The tracked rows, ascending."""
        return np.nonzero(self.c_state & TRACKED)[0]

    def tracks_exactly(self, rows: np.ndarray) -> bool:
        """Are `rows` (ascending) the tracked rows, no more, no fewer?"""
        return np.array_equal(self.rows(), rows)

    def _refuse_tracked(self, row: int) -> None:
        if row in self:
            raise InvalidArgument(f"row {row} of namespace {self.table.name} is already tracked")

    def _track(self, row: int, in_main: int = 0) -> int:
        """Start tracking `row` (state fresh, a new gen); its place, for the caller to queue."""
        self._refuse_tracked(row)
        if row >= len(self.m_state):
            self._columns(max(2 * len(self.m_state), row + 1), len(self.m_state))
        gen = (self.m_gen[row] + 1) & GEN_MASK
        self.m_gen[row], self.m_state[row] = gen, TRACKED | in_main
        self._tracked += 1
        self._tracked_bytes += self.table.m_size[row]
        return row | gen << GEN_SHIFT

    def _refuse_tracked_many(self, rows: np.ndarray) -> None:
        if (self.c_state[rows[rows < len(self.c_state)]] & TRACKED).any():
            raise InvalidArgument(f"a row of {rows.tolist()[:8]} of namespace {self.table.name} is already tracked")

    def _track_many(self, rows: np.ndarray, in_main: int = 0) -> np.ndarray:
        """_track for many rows at once (distinct, none tracked); their places, in order."""
        if not len(rows):
            return np.zeros(0, np.int64)
        self._refuse_tracked_many(rows)
        top = int(rows.max())
        if top >= len(self.m_state):
            self._columns(max(2 * len(self.m_state), top + 1), len(self.m_state))
        gen = (self.c_gen[rows] + 1) & GEN_MASK
        self.c_gen[rows], self.c_state[rows] = gen, TRACKED | in_main
        self._tracked += len(rows)
        self._tracked_bytes += int(self.table.c_size[rows].sum())
        return rows.astype(np.int64) | gen.astype(np.int64) << GEN_SHIFT

    def on_insert_many(self, rows: np.ndarray) -> None:
        """on_insert of each row (distinct, none tracked), in order."""
        for row in rows.tolist():
            self.on_insert(row)

    def _untrack(self, row: int) -> tuple[int, int]:
        """Forget a tracked row: (its state, its size)."""
        state, size = self.m_state[row], self.table.m_size[row]
        self.m_state[row] = 0
        self._tracked -= 1
        self._tracked_bytes -= size
        return state, size

    def _stale_places(self) -> int:
        return sum(len(ring) for ring, _ in self._queues()) - self._tracked

    def _drop_stale_if_many(self) -> None:
        if self._stale_places() > max(COMPACT_MIN_KEYS, self._tracked):
            self._drop_stale()

    def _live(self, places: np.ndarray, in_main: int) -> np.ndarray:
        rows = (places & ROW_MASK).astype(np.intp)
        state = self.c_state[rows]
        return (self.c_gen[rows] == places >> GEN_SHIFT) & (state & TRACKED != 0) & (state & IN_MAIN == in_main)

    def _drop_stale(self) -> None:
        """Every queue without its stale places, order kept."""
        for ring, in_main in self._queues():
            places = ring.items()
            ring.replace(places[self._live(places, in_main)])

    def renumber(self, keep: np.ndarray) -> None:
        """The table moved row keep[i] to row i (a compaction; keep empty: it started over)."""
        self._drop_stale()  # every place left is live, and its row is in keep
        old = self.c_state
        if len(keep) and int(keep.max()) >= len(old):
            old = np.concatenate([old, np.zeros(int(keep.max()) + 1 - len(old), np.uint8)])
        self._columns(max(MIN_ROWS, 2 * len(keep)), 0)  # gens start again at 0: places are rows
        self.c_state[:len(keep)] = old[keep]
        new_row = np.full(len(old), -1, np.int64)
        new_row[keep] = np.arange(len(keep))
        for ring, _ in self._queues():
            ring.replace(new_row[(ring.items() & ROW_MASK).astype(np.intp)])

    def compact(self) -> bool:
        """Housekeeping: queues mostly stale or mostly empty buffer get rebuilt. True if any was."""
        rebuilt = False
        if self._stale_places() > self._tracked // 4:
            self._drop_stale()
            rebuilt = True
        for ring, _ in self._queues():
            rebuilt = ring.shrink() or rebuilt
        return rebuilt

    def _check_queues(self, fail) -> None:
        """Every tracked row has exactly one live place, in the queue its state names."""
        seen = np.zeros(len(self.c_state), np.int64)
        for ring, in_main in self._queues():
            places = ring.items()
            live = places[self._live(places, in_main)]
            seen += np.bincount((live & ROW_MASK).astype(np.intp), minlength=len(seen))
        tracked = self.c_state & TRACKED != 0
        if not (np.array_equal(seen[tracked], np.ones(int(tracked.sum()), np.int64)) and not seen[~tracked].any()):
            raise fail("a tracked row has no live place or more than one, or an untracked row has one")
        rows = np.nonzero(tracked)[0]
        if len(rows) != self._tracked:
            raise fail(f"{len(rows)} rows are tracked, counted {self._tracked}")
        if len(rows) and rows[-1] >= self.table.end:
            raise fail(f"row {rows[-1]} is tracked, the table has used {self.table.end} rows")
        total = int(self.table.c_size[rows].sum())
        if total != self._tracked_bytes:
            raise fail(f"tracked_bytes is {self._tracked_bytes}, the tracked rows hold {total}")

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first inconsistency. O(rows)."""
        def fail(message: str) -> RuntimeError:
            return RuntimeError(f"{self.name} policy of namespace {self.table.name} is inconsistent: {message}")
        self._check_queues(fail)
        self._check_structure(fail)

    def _check_structure(self, fail) -> None:
        pass


class RowS3FIFO(RowPolicy):
    """kvstore/policy/s3fifo.py over rows: S (probation), M (main), G (ghost ids of S's victims)."""

    name = "s3fifo"

    def __init__(self, table, capacity_bytes: int):
        super().__init__(table, capacity_bytes)
        self.small_target_bytes = max(1, int(capacity_bytes * SMALL_QUEUE_FRACTION))
        self._small, self._main = Ring(dtype=np.int64), Ring(dtype=np.int64)
        self._ghost = Ghost(capacity_bytes - self.small_target_bytes)
        self._small_bytes = self._main_bytes = 0

    def _queues(self):
        return (self._small, 0), (self._main, IN_MAIN)

    def on_insert(self, row: int) -> None:
        self._refuse_tracked(row)  # before the ghost changes
        if self._ghost.take(self.table.m_hash[row]):  # seen recently: straight to M
            self._main.append(self._track(row, IN_MAIN))
            self._main_bytes += self.table.m_size[row]
        else:
            self._small.append(self._track(row))
            self._small_bytes += self.table.m_size[row]

    def on_insert_many(self, rows: np.ndarray) -> None:
        """As on_insert row by row: those the ghost remembers go to M, the rest to S."""
        self._refuse_tracked_many(rows)  # before the ghost changes
        seen = np.zeros(len(rows), bool)
        if len(self._ghost):
            seen[:] = [self._ghost.take(h) for h in self.table.c_hash[rows].tolist()]
        if seen.any():
            self._main.extend(self._track_many(rows[seen], IN_MAIN))
            self._main_bytes += int(self.table.c_size[rows[seen]].sum())
        if not seen.all():
            self._small.extend(self._track_many(rows[~seen]))
            self._small_bytes += int(self.table.c_size[rows[~seen]].sum())

    def on_access(self, row: int) -> None:
        if row < len(self.m_state):
            state = self.m_state[row]
            if state & TRACKED and state & FREQ_MASK < MAX_FREQ:
                self.m_state[row] = state + 1

    def on_remove(self, row: int) -> None:
        if row not in self:
            return
        state, size = self._untrack(row)
        if state & IN_MAIN:
            self._main_bytes -= size
        else:
            self._small_bytes -= size
        self._drop_stale_if_many()

    def victims(self, bytes_needed: int, evictable: Callable[[int], bool]) -> list[int]:
        """Rows to evict towards `bytes_needed` (kvstore/policy/base.py: EvictionPolicy.victims)."""
        if bytes_needed <= 0:
            return []
        scan = _Scan(evictable)
        chosen: list[int] = []
        freed = 0
        try:
            while freed < bytes_needed:
                from_small = bool(self._small) and (self._small_bytes >= self.small_target_bytes or not self._main)
                if not from_small and not self._main:
                    break
                place = self._select(from_small, scan)
                if place is None:
                    continue
                row = place & ROW_MASK
                freed += self._evict(row, from_small)
                chosen.append(row)
        finally:
            self._small.push_tail(scan.skipped_small)
            self._main.push_tail(scan.skipped_main)
        return chosen

    def _select(self, from_small: bool, scan: _Scan) -> int | None:
        return self._next_candidate(from_small, scan)

    def _next_candidate(self, from_small: bool, scan: _Scan) -> int | None:
        """Run S3-FIFO from the queue's tail until an evictable, exhausted row comes out: its
        place (popped), or None once the queue ran dry."""
        queue = self._small if from_small else self._main
        want = 0 if from_small else IN_MAIN
        states, gens, sizes = self.m_state, self.m_gen, self.table.m_size
        while queue:
            place = queue.popleft()
            row = place & ROW_MASK
            state = states[row]
            if gens[row] != place >> GEN_SHIFT or not state & TRACKED or state & IN_MAIN != want:
                continue  # stale
            if not scan.evictable(row):
                (scan.skipped_small if from_small else scan.skipped_main).append(place)
                continue
            step = tail_step(from_small, state & FREQ_MASK)
            if step is EVICT:
                return place
            if step is PROMOTE:
                size = sizes[row]
                self._small_bytes -= size
                states[row] = state | IN_MAIN
                self._main.append(place)
                self._main_bytes += size
            else:
                states[row] = state - 1
                queue.append(place)
        return None

    def _evict(self, row: int, from_small: bool) -> int:
        """Untrack a victim (an S victim's id goes to the ghost); its size."""
        h = self.table.m_hash[row]
        _, size = self._untrack(row)
        if not from_small:
            self._main_bytes -= size
            return size
        self._small_bytes -= size
        self._ghost.remember(h, size)
        return size

    def compact(self) -> bool:
        rebuilt = sparse(len(self._ghost), self._ghost.peak)
        if rebuilt:  # a dict keeps its peak's table
            self._ghost.rebuild()
        return super().compact() or rebuilt

    def _check_structure(self, fail) -> None:
        for name, ring, in_main, recorded in (("S", self._small, 0, self._small_bytes),
                                              ("M", self._main, IN_MAIN, self._main_bytes)):
            places = ring.items()
            rows = (places[self._live(places, in_main)] & ROW_MASK).astype(np.intp)
            total = int(self.table.c_size[rows].sum())
            if total != recorded:
                raise fail(f"{name} records {recorded} bytes, holds {total}")
        self._ghost.check(fail)
        tracked_hashes = set(self.table.c_hash[self.rows()].tolist())
        if tracked_hashes & self._ghost.sizes.keys():
            raise fail("a tracked id is also in the ghost queue")


class RowCostAwareS3FIFO(RowS3FIFO):
    """kvstore/policy/cost_aware.py over rows: the cheapest of up to 4 exhausted candidates."""

    name = "cost_aware"

    def _score(self, row: int) -> float:
        hints = self.table.hints_at(row)
        state = (self.table.m_size[row] << SIZE_SHIFT | (hints.priority - MIN_PRIORITY) << PRIORITY_SHIFT
                 | self.m_state[row] & FREQ_MASK)
        return score(state, hints.recompute_cost_ms)

    def _select(self, from_small: bool, scan: _Scan) -> int | None:
        candidates: list[int] = []
        while len(candidates) < CANDIDATE_WINDOW:
            place = self._next_candidate(from_small, scan)
            if place is None:
                break
            candidates.append(place)
        if not candidates:
            return None
        # min() keeps the first of equal scores: the oldest, as plain FIFO would.
        best = min(range(len(candidates)), key=lambda i: self._score(candidates[i] & ROW_MASK))
        (self._small if from_small else self._main).push_tail(candidates[:best] + candidates[best + 1:])
        return candidates[best]


class RowLRU(RowPolicy):
    """kvstore/policy/lru.py over rows: a hit queues the row anew (its older place goes stale)."""

    name = "lru"

    def __init__(self, table, capacity_bytes: int):
        super().__init__(table, capacity_bytes)
        self._order = Ring(dtype=np.int64)  # least recent first

    def _queues(self):
        return ((self._order, 0),)

    def on_insert(self, row: int) -> None:
        self._order.append(self._track(row))

    def on_insert_many(self, rows: np.ndarray) -> None:
        self._order.extend(self._track_many(rows))

    def on_access(self, row: int) -> None:
        if row in self:
            gen = (self.m_gen[row] + 1) & GEN_MASK
            self.m_gen[row] = gen
            self._order.append(row | gen << GEN_SHIFT)
            self._drop_stale_if_many()

    def on_remove(self, row: int) -> None:
        if row in self:
            self._untrack(row)
            self._drop_stale_if_many()

    def victims(self, bytes_needed: int, evictable: Callable[[int], bool]) -> list[int]:
        if bytes_needed <= 0:
            return []
        chosen: list[int] = []
        skipped: list[int] = []
        freed = 0
        states, gens, order = self.m_state, self.m_gen, self._order
        try:
            while freed < bytes_needed and order:
                place = order.popleft()
                row = place & ROW_MASK
                if gens[row] != place >> GEN_SHIFT or not states[row] & TRACKED:
                    continue  # stale
                if evictable(row):
                    freed += self._untrack(row)[1]
                    chosen.append(row)
                else:
                    skipped.append(place)
        finally:
            order.push_tail(skipped)
        return chosen


ROW_POLICIES: dict[str, type[RowPolicy]] = {cls.name: cls for cls in (RowS3FIFO, RowCostAwareS3FIFO, RowLRU)}


def make_row_policy(name: str, table, capacity_bytes: int) -> RowPolicy:
    """The policy registered as `name` (kvstore/policy: POLICIES names the same) over `table`'s rows."""
    cls = ROW_POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; use one of: {', '.join(sorted(ROW_POLICIES))}")
    return cls(table, capacity_bytes)
