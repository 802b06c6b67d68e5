"""NvmeTable.check_integrity (server/tiering/nvme_table.py): every invariant of its columns,
slots and queues, vectorised. O(n); the daemon runs it while it indexes few objects."""

from __future__ import annotations

import numpy as np

from kvstore.identity import ID_BYTES
from kvstore.policy.base import (
    IN_MAIN,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITY_SHIFT,
    SIZE_SHIFT,
)
from kvstore.policy.s3fifo import MAX_GHOST_ENTRIES
from kvstore.server.tiering.nvme_table_load import EMPTY, GONE


class TableChecks:
    """NvmeTable.check_integrity: a part of that class, in its own file."""

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first inconsistency. O(n)."""
        def fail(message: str):
            return RuntimeError(f"the NVMe table is inconsistent: {message}")

        n = self._next
        state, stale = self.state[:n], self.stale[:n]
        alive = state != 0
        if int(alive.sum()) != self._live:
            raise fail(f"{int(alive.sum())} rows are live, {self._live} are counted")
        sizes = np.where(alive, state >> SIZE_SHIFT, 0)
        priority = ((state >> PRIORITY_SHIFT) & 0b11111) + MIN_PRIORITY
        if (alive & ((sizes <= 0) | (priority > MAX_PRIORITY))).any():
            raise fail("a live row has a size <= 0 or a priority out of range")
        if int(sizes.sum()) != self._tracked_bytes:
            raise fail(f"tracked_bytes is {self._tracked_bytes}, the rows sum to {int(sizes.sum())}")
        in_main = (state & IN_MAIN) != 0
        for name, ring, mine, recorded in (("S", self._small, alive & ~in_main, self._small_bytes),
                                           ("M", self._main, alive & in_main, self._main_bytes)):
            rows = ring.items()
            if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n):
                raise fail(f"{name} holds a row out of range")
            places = np.bincount(rows, minlength=n)[:n]
            if (places[mine] != 1).any():
                raise fail(f"a live row of {name} has {int(places[mine][places[mine] != 1][0])} places in it")
            if (places[alive & ~mine] != 0).any():
                raise fail(f"{name} holds a place of a row that lives in the other queue")
            if int(sizes[mine].sum()) != recorded:
                raise fail(f"{name} records {recorded} bytes, holds {int(sizes[mine].sum())}")
        dead_places = np.bincount(np.concatenate([self._small.items(), self._main.items()]), minlength=n)[:n]
        if (dead_places[~alive] != stale[~alive]).any() or stale[alive].any():
            raise fail("a dead row's queue places differ from its stale count")
        if int(stale.sum()) != self._num_stale:
            raise fail(f"{self._num_stale} stale places are counted, the rows record {int(stale.sum())}")
        free = np.asarray(self._free, np.int64)
        if len(set(self._free)) != len(free) or set(self._free) != set(np.nonzero(~alive & (stale == 0))[0].tolist()):
            raise fail("the free rows are not exactly the dead rows without queue places")
        self._check_slots(alive, fail)
        live = np.nonzero(alive)[0]
        keys = np.concatenate([self.ns[live].astype("<u2").view(np.uint8).reshape(-1, 2), self.ids[live]], axis=1)
        if len(np.unique(np.ascontiguousarray(keys).view(f"V{2 + ID_BYTES}").reshape(-1))) != self._live:
            raise fail("a key is tracked twice")
        if any(key in self for key in self._ghost):
            raise fail("a tracked key is also in the ghost queue")
        if sum(self._ghost.values()) != self._ghost_bytes:
            raise fail(f"ghost records {self._ghost_bytes} bytes, holds {sum(self._ghost.values())}")
        if self._ghost_bytes > self.ghost_capacity_bytes or len(self._ghost) > MAX_GHOST_ENTRIES:
            raise fail(f"ghost holds {len(self._ghost)} keys / {self._ghost_bytes} bytes, over its bound")

    def _check_slots(self, alive: np.ndarray, fail) -> None:
        slots = self._slots
        held = np.nonzero(slots >= 0)[0]
        rows = slots[held].astype(np.int64)
        if len(rows) and int(rows.max()) >= self._next:
            raise fail("a slot names a row out of range")
        if not np.array_equal(np.bincount(rows, minlength=self._next)[:self._next], alive.astype(np.int64)):
            raise fail("the slots do not hold each live row exactly once")
        if int((slots == GONE).sum()) != self._gone or 2 * (self._live + self._gone) > len(slots):
            raise fail("the slots' tombstone count or load is wrong")
        # Each row is found by probing from its home: no EMPTY slot lies between them.
        empties = np.concatenate([[0], np.cumsum(slots == EMPTY)])
        home = self._homes(rows)
        between = np.where(home <= held, empties[held] - empties[home],
                           empties[-1] - empties[home] + empties[held])
        if (between != 0).any():
            raise fail("a row lies past an empty slot from its home: probes cannot find it")
