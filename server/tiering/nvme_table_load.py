"""NvmeTable's bulk load (server/tiering/nvme_table.py): what recovery found, into numpy
columns and the slots table in a few vectorised passes (10 M objects: 1.3-1.7 s, the age
order sorted meanwhile in another thread)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.policy.base import PRIORITY_ZERO, SIZE_SHIFT

EMPTY, GONE = -1, -2  # a slot's marks: never used, and a removed row's (a tombstone)


class BulkLoad:
    """NvmeTable's bulk load: a part of that class, in its own file."""

    def load(self, prefixes: list[bytes], namespaces: list[np.ndarray], ids: list[np.ndarray],
             sizes: np.ndarray, order: np.ndarray | Future) -> None:
        """Learn what recovery found (tiers/nvme/holdings.py: chunks of prefix numbers and ids)
        into an empty table, as on_insert of each object in `order` (oldest first) would: all
        enter S. `order` may be a Future, computed meanwhile (numpy sorts outside the GIL: 10 M
        objects load in 1.3-1.7 s so, 2.9 s one after the other)."""
        if self._live or self._next:
            raise InvalidArgument("load() fills an empty NVMe table only")
        n = len(sizes)
        if not (sum(map(len, namespaces)) == n == sum(map(len, ids))) or (n and int(np.min(sizes)) <= 0):
            raise InvalidArgument("load() needs one positive size and one id per object")
        self.prefixes, self._number = list(prefixes), {p: i for i, p in enumerate(prefixes)}
        self._columns(max(16, n + n // 8))
        self._slots = np.full(self._slot_count(len(self.state)), EMPTY, np.int32)
        rows = np.arange(n)
        for column, chunks in ((self.ns, namespaces), (self.ids, ids)):
            at = 0
            for chunk in chunks:  # copied once, straight from the scan's chunks
                column[at:at + len(chunk)] = chunk
                at += len(chunk)
        self.hash[:n] = self._hashes(self.ns[:n], self.ids[:n])
        self.state[:n] = (np.asarray(sizes, np.int64) << SIZE_SHIFT) | PRIORITY_ZERO
        self._next, self._live = n, n
        self._place(rows)
        if isinstance(order, Future):
            order = order.result()
        if self._live != n or len(order) != n or (n and not np.array_equal(np.bincount(order, minlength=n), np.ones(n))):
            self.__init__(self.capacity_bytes)
            raise InvalidArgument("load() needs distinct keys, and an order that names each object once")
        self._small.extend(np.asarray(order, np.int32))
        self._tracked_bytes = self._small_bytes = int(np.sum(sizes))

    def _place(self, rows: np.ndarray) -> None:
        """Put rows into the slots table, which holds no tombstone, in rounds: each round every
        row still unplaced tries its next slot, and of rows that try the same empty slot one
        wins. A row moves on only past an occupied slot, so each is found by probing from its
        home. A row whose key a placed row has already (a duplicate) is left out of the table
        and of _live."""
        mask = len(self._slots) - 1
        at = self._homes(rows)
        while len(rows):
            empty = self._slots[at] == EMPTY
            self._slots[at[empty]] = rows[empty]  # of rows trying one slot, the last write wins
            occupant = self._slots[at]
            lost = occupant != rows
            rows, at, occupant = rows[lost], at[lost], occupant[lost]
            same = self.hash[occupant] == self.hash[rows]
            if same.any():  # twins meet on their common probe path
                maybe = np.nonzero(same)[0]
                twin = np.zeros(len(rows), bool)
                twin[maybe] = (self.ns[occupant[maybe]] == self.ns[rows[maybe]]) & \
                    (self.ids[occupant[maybe]] == self.ids[rows[maybe]]).all(axis=1)
                if twin.any():
                    self._live -= int(twin.sum())
                    rows, at = rows[~twin], at[~twin]
            at = (at + 1) & mask
