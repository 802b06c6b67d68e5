"""The eviction-policy interface every tier uses, and the bookkeeping all policies share."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Hashable

from kvstore.errors import InvalidArgument

# Same range as `Hints.priority`: tiers pass the hint through unchanged.
MIN_PRIORITY, MAX_PRIORITY = -10, 10

# What a policy remembers about a tracked object is one int, its state, not an object per key:
# a tier may track tens of millions of objects, and an object with its dict costs ~120 B more.
# Bits 0-1: freq (0..3, hits not yet spent); bit 2: in S3-FIFO's main queue;
# bits 3-7: priority - MIN_PRIORITY; bits 8 and up: size_bytes. Only freq and the queue bit
# ever change. A recompute cost, when hinted, is kept beside it (EvictionPolicy._costs).
FREQ_MASK = 0b11
IN_MAIN = 1 << 2
PRIORITY_SHIFT = 3
SIZE_SHIFT = 8
PRIORITY_ZERO = -MIN_PRIORITY << PRIORITY_SHIFT  # the priority bits of priority 0


# Equal states are one int object: most objects of a tier have one of a few sizes (a block, a
# page), and an int of its own costs each key 32 B. Bounded, shared by every policy
# of the process (ints are immutable); past the bound a state is simply not shared.
MAX_SHARED_STATES = 1 << 16
_SHARED_STATES: dict[int, int] = {}


def shared(state: int) -> int:
    """The one int object equal to `state` (or `state` itself once the table is full)."""
    got = _SHARED_STATES.get(state)
    if got is None:
        if len(_SHARED_STATES) >= MAX_SHARED_STATES:
            return state
        got = _SHARED_STATES[state] = state
    return got


def size_of(state: int) -> int:
    return state >> SIZE_SHIFT


def priority_of(state: int) -> int:
    return ((state >> PRIORITY_SHIFT) & 0b11111) + MIN_PRIORITY


class EvictionPolicy(abc.ABC):
    """Tracks objects of one tier and chooses victims. Decides only: never does I/O.

    A policy belongs to one tier and is called by that tier's owner only (one thread or one
    event loop); it takes no lock. Keys are opaque hashables chosen by the tier.

    Protocol: `on_insert` once per object the tier admits, `on_access` on every hit,
    `on_remove` on explicit delete or expiry, `victims()` when the tier needs room.
    Every call is O(1) except `victims()` (amortized O(victims + skipped)) and
    `check_integrity()` (O(n)).
    """

    name: str  # the registry name, set by each implementation

    def __init__(self, capacity_bytes: int):
        if not _is_int(capacity_bytes) or capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._entries: dict[Hashable, int] = {}  # key -> state (see FREQ_MASK)
        self._costs: dict[Hashable, float] = {}  # key -> recompute cost, for keys that were given one
        self._tracked_bytes = 0
        self._peak_entries = 0  # the most keys tracked since the last compact()

    @abc.abstractmethod
    def on_insert(
        self, key: Hashable, size_bytes: int, recompute_cost: float | None = None, priority: int = 0
    ) -> None:
        """Start tracking `key`. Raises InvalidArgument if it is already tracked or a field is bad.

        recompute_cost: what a miss costs (any unit, >= 0); None when the producer gave no hint.
        priority: -10..10, higher is kept longer.
        """

    @abc.abstractmethod
    def on_access(self, key: Hashable) -> None:
        """Record a hit on `key`. An untracked key is ignored."""

    @abc.abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """Forget `key` (explicit delete or expiry). Idempotent: an untracked key is ignored."""

    @abc.abstractmethod
    def victims(self, bytes_needed: int, evictable: Callable[[Hashable], bool]) -> list:
        """Choose keys to evict so that the sum of their sizes >= bytes_needed.

        If the evictable bytes are not enough, every evictable key is returned. Keys for
        which `evictable(key)` is False (pinned, leased) are never returned and keep their
        state. The returned keys are no longer tracked (as if `on_remove` had been called);
        the caller must now remove them from the tier. `bytes_needed <= 0` returns [].
        `evictable` is called only with tracked keys and must not call back into the policy.
        """

    @abc.abstractmethod
    def _check_structure(self) -> None:
        """Check the implementation's own queues; raise RuntimeError via `_integrity_error`."""

    def __len__(self) -> int:
        return len(self._entries)

    def size_of(self, key: Hashable) -> int | None:
        """The size `key` was tracked with; None if it is not tracked."""
        state = self._entries.get(key)
        return None if state is None else size_of(state)

    def keys(self) -> list:
        """The tracked keys (a copy: safe to hold while the policy changes)."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def tracked_bytes(self) -> int:
        """Sum of the sizes of the tracked objects."""
        return self._tracked_bytes

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first inconsistency in the bookkeeping. O(n)."""
        total = 0
        for key, state in self._entries.items():
            if size_of(state) <= 0 or not MIN_PRIORITY <= priority_of(state) <= MAX_PRIORITY:
                raise self._integrity_error(f"key {key!r} has size {size_of(state)}, priority {priority_of(state)}")
            total += size_of(state)
        if total != self._tracked_bytes:
            raise self._integrity_error(f"tracked_bytes is {self._tracked_bytes}, entries sum to {total}")
        if not self._costs.keys() <= self._entries.keys():
            raise self._integrity_error("a recompute cost is kept for a key that is not tracked")
        self._check_structure()

    def _integrity_error(self, message: str) -> RuntimeError:
        return RuntimeError(f"{self.name} policy is inconsistent: {message}")

    def _add_entry(
        self, key: Hashable, size_bytes: int, recompute_cost: float | None, priority: int
    ) -> int:
        """Validate an insert and record its state (freq 0, not in main); the caller places it
        in its queues."""
        if key in self._entries:
            raise InvalidArgument(f"key {key!r} is already tracked; remove it before inserting it again")
        if not _is_int(size_bytes) or size_bytes <= 0:
            raise InvalidArgument(f"size_bytes must be a positive integer, got {size_bytes!r}")
        if recompute_cost is not None and (
            not isinstance(recompute_cost, (int, float)) or isinstance(recompute_cost, bool)
            or not math.isfinite(recompute_cost) or recompute_cost < 0
        ):
            raise InvalidArgument(f"recompute_cost must be a finite number >= 0 or None, got {recompute_cost!r}")
        if not _is_int(priority) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidArgument(
                f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority!r}"
            )
        state = shared(size_bytes << SIZE_SHIFT | (priority - MIN_PRIORITY) << PRIORITY_SHIFT)
        self._entries[key] = state
        if recompute_cost is not None:
            self._costs[key] = recompute_cost
        self._tracked_bytes += size_bytes
        if len(self._entries) > self._peak_entries:
            self._peak_entries = len(self._entries)
        return state

    def compact(self) -> bool:
        """Rebuild the containers once removals left them sparse (a quarter of their peak or
        less, from COMPACT_MIN_KEYS up): Python dicts never shrink, so a policy that tracked a
        million keys keeps their tables after they go. Order is kept. True if it rebuilt."""
        if not sparse(len(self._entries), self._peak_entries):
            return False
        self._entries, self._costs = dict(self._entries), dict(self._costs)
        self._rebuild_queues()
        self._peak_entries = len(self._entries)
        return True

    def _rebuild_queues(self) -> None:
        """Copy each queue into a fresh container of the same kind and order (compact)."""

    def _drop_entry(self, key: Hashable) -> int:
        """Forget a tracked key; its state is returned, the caller takes it out of its queues."""
        state = self._entries.pop(key)
        if self._costs:
            self._costs.pop(key, None)
        self._tracked_bytes -= size_of(state)
        return state


# Below this many keys at peak a sparse table costs less than rebuilding it.
COMPACT_MIN_KEYS = 4096


def sparse(size: int, peak: int) -> bool:
    """Would a container holding `size` items, after holding `peak`, be worth rebuilding?"""
    return peak >= COMPACT_MIN_KEYS and 4 * size <= peak


# A fresh dict of n keys takes at most this many bytes a key (CPython 3.11-3.13: a table of at
# most 3n index slots of up to 8 bytes, and room for 2n entries of 24).
_FRESH_DICT_BYTES_PER_KEY = 72


def outgrown(table: dict) -> bool:
    """Would rebuilding `table` give back most of it? A dict keeps the table of its peak (deletes
    never shrink it): worth a rebuild from COMPACT_MIN_KEYS keys' worth of table up, once it is 4x
    what a fresh one of its keys would take. For dicts whose inserts are too many to count a
    peak at; O(1)."""
    held = table.__sizeof__()  # (the table's bytes)
    return (held >= COMPACT_MIN_KEYS * _FRESH_DICT_BYTES_PER_KEY
            and held > 4 * _FRESH_DICT_BYTES_PER_KEY * max(1, len(table)))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
