"""The daemon's index of what the NVMe tier holds, and its eviction order: S3-FIFO over columns.

A node's NVMe holds tens of millions of objects. Kept as Python objects (a key, a state int,
a dict slot, a queue place each) they cost ~190 B per object, and a 10 M-object start spent
~16 s building the dict and queues. Here every object is a row of numpy columns:

    ns[row]     uint16   number of its index key's prefix (u16 length, namespace): prefixes
    ids[row]    32 B     its id;  hash[row] uint64: keyed hash of (ns, id), compared first
    state[row]  int64    kvstore/policy/base.py's state (size, priority, freq, in-main bit);
                         0: the row is free, or dead with queue places still to skip
    stale[row]  uint32   how many places a dead row still has in S and M
    slots       int32    open addressing, linear probing from the hash's top bits: a row,
                         EMPTY or GONE (a tombstone); at most half full. Ids are chosen by
                         clients, so the hash is keyed (per process secret) and mixes all 32
                         bytes: ids crafted to share a prefix do not share a probe chain
    S, M        int32    FIFO rings of rows (kvstore/policy/s3fifo.py: the same algorithm and
                         the same victims, key for key; tests/server/tiering/test_nvme_table.py)

About 64 B per object; a bulk load of 10 M rows takes seconds, vectorised. Keys at the
interface are the NVMe index's own keys (tiers/nvme/index.py: object_key). A removed key's
place stays queued and its row is not reused until the queue has passed it (or the queues
are rebuilt), so a place never names another key. Ghost keys (G) stay a bounded OrderedDict
(kvstore.policy.s3fifo.Ghost).
Called on the event loop only, like every policy.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.identity import ID_BYTES
from kvstore.policy.base import (
    FREQ_MASK,
    IN_MAIN,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITY_SHIFT,
    PRIORITY_ZERO,
    SIZE_SHIFT,
    sparse,
)
from kvstore.policy.s3fifo import EVICT, MAX_FREQ, PROMOTE, SMALL_QUEUE_FRACTION, Ghost, tail_step
from kvstore.server.tiering.fifo_ring import Ring
from kvstore.server.tiering.open_slots import EMPTY, GONE, find, place
from kvstore.tiers.nvme.holdings import index_keys, prefix_number

_M64 = (1 << 64) - 1
_WORDS = struct.Struct("<4Q")


class NvmeTable:
    """S3-FIFO over numpy columns, one row per object the NVMe tier holds (see above)."""

    name = "s3fifo"

    def __init__(self, capacity_bytes: int, rows: int = 1024):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidArgument(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.small_target_bytes = max(1, int(capacity_bytes * SMALL_QUEUE_FRACTION))
        # The hash's secret: a start value and two odd multipliers (see _hash).
        self._seed, self._k1, self._k2 = secrets.randbits(64), secrets.randbits(64) | 1, secrets.randbits(64) | 1
        self.prefixes: list[bytes] = []
        self._number: dict[bytes, int] = {}
        self._columns(max(16, rows))
        self._slots = np.full(self._slot_count(len(self.state)), EMPTY, np.int32)
        self._next = 0  # rows below it have been used
        self._free: list[int] = []
        self._live = self._gone = 0
        self._small, self._main = Ring(), Ring()
        self._ghost = Ghost(capacity_bytes - self.small_target_bytes)
        self._small_bytes = self._main_bytes = self._tracked_bytes = 0
        self._num_stale = 0

    def _columns(self, rows: int) -> None:
        self.ns = np.zeros(rows, np.uint16)
        self.ids = np.zeros((rows, ID_BYTES), np.uint8)
        self.hash = np.zeros(rows, np.uint64)
        self.state = np.zeros(rows, np.int64)
        self.stale = np.zeros(rows, np.uint32)

    @staticmethod
    def _slot_count(rows: int) -> int:
        return 1 << max(4, (2 * rows - 1).bit_length())

    # --- keys and rows ------------------------------------------------------------------

    def _parse(self, key: bytes, add: bool = False) -> tuple[int, bytes, int] | None:
        """(prefix number, id, hash) of an index key; None for a prefix never seen (unless add)."""
        if type(key) is not bytes or len(key) <= ID_BYTES + 2:
            raise InvalidArgument(f"an NVMe table key is an NVMe index key (bytes), got {key!r}")
        prefix, oid = key[:-ID_BYTES], key[-ID_BYTES:]
        number = self._number.get(prefix)
        if number is None:
            if not add:
                return None
            number = prefix_number(self._number, prefix)
            self.prefixes.append(prefix)
        return number, oid, self._hash(number, oid)

    def _hash(self, number: int, oid: bytes) -> int:
        """Per word of the id: xor, multiply by a secret odd number, fold the high half down;
        each step is a bijection, so ids that differ in one word never collide."""
        w0, w1, w2, w3 = _WORDS.unpack(oid)
        k1 = self._k1
        h = ((self._seed ^ number ^ w0) * k1) & _M64  # unrolled: a loop cost a third more
        h = (((h ^ (h >> 32)) ^ w1) * k1) & _M64
        h = (((h ^ (h >> 32)) ^ w2) * k1) & _M64
        h = (((h ^ (h >> 32)) ^ w3) * k1) & _M64
        return h ^ (h >> 32)

    def _hashes(self, numbers: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """_hash of many (number, id) at once."""
        h = np.uint64(self._seed) ^ numbers.astype(np.uint64)
        k1, fold = np.uint64(self._k1), np.uint64(32)
        with np.errstate(over="ignore"):
            for word in np.ascontiguousarray(ids).view(np.uint64).reshape(-1, 4).T:
                h = (h ^ word) * k1
                h ^= h >> fold
        return h

    def _home(self, h: int) -> int:
        return ((h * self._k2) & _M64) >> self._shift()

    def _shift(self) -> int:
        return 64 - (len(self._slots).bit_length() - 1)

    def _homes(self, rows: np.ndarray) -> np.ndarray:
        return self._homes_of(self.hash[rows])

    def _homes_of(self, hashes: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((hashes * np.uint64(self._k2)) >> np.uint64(self._shift())).astype(np.int64)

    def _find(self, number: int, oid: bytes, h: int) -> tuple[int, int]:
        """(row, its slot) of a tracked key, or (-1, the slot an insert takes)."""
        slots, hashes, mask = self._slots, self.hash, len(self._slots) - 1
        at, free = self._home(h), -1
        while True:
            row = slots.item(at)
            if row == EMPTY:
                return -1, (at if free < 0 else free)
            if row == GONE:
                if free < 0:
                    free = at
            elif hashes.item(row) == h and self.ns.item(row) == number and self.ids[row].tobytes() == oid:
                return row, at
            at = (at + 1) & mask

    def _row_of(self, key: bytes) -> int:
        parsed = self._parse(key)
        return -1 if parsed is None else self._find(*parsed)[0]

    def key_of(self, row: int) -> bytes:
        return self.prefixes[int(self.ns[row])] + self.ids[row].tobytes()

    # --- the policy interface (kvstore/policy/base.py) --------------------------------

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return self._row_of(key) >= 0

    def size_of(self, key: bytes) -> int | None:
        row = self._row_of(key)
        return None if row < 0 else int(self.state[row]) >> SIZE_SHIFT

    def sizes_of(self, prefix: bytes, ids: np.ndarray) -> np.ndarray:
        """Size of each id ((n, 32) uint8) under an index key prefix, 0 where untracked: all
        probed at once (a key at a time costs ~2.5 us in Python; a lookup of 1,000 keys less)."""
        sizes = np.zeros(len(ids), np.int64)
        number = self._number.get(prefix)
        if number is None or not len(ids):
            return sizes
        hashes = self._hashes(np.full(len(ids), number, np.uint16), ids)

        def matches(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
            return (self.hash[rows] == hashes[keys]) & (self.ns[rows] == number) & (self.ids[rows] == ids[keys]).all(axis=1)
        rows = find(self._slots, self._homes_of(hashes), matches,
                    lambda key: self._find(number, ids[key].tobytes(), int(hashes[key]))[0])
        held = rows >= 0
        sizes[held] = self.state[rows[held]] >> SIZE_SHIFT
        return sizes

    @property
    def tracked_bytes(self) -> int:
        return self._tracked_bytes

    def keys(self) -> list[bytes]:
        """Every tracked key (a copy), in row order."""
        rows = np.nonzero(self.state[:self._next])[0]
        return index_keys(self.prefixes, self.ns[rows], self.ids[rows])

    def on_insert(self, key: bytes, size_bytes: int, recompute_cost: float | None = None, priority: int = 0) -> None:
        if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes <= 0:
            raise InvalidArgument(f"size_bytes must be a positive integer, got {size_bytes!r}")
        if recompute_cost is not None:
            raise InvalidArgument("the NVMe table keeps no recompute cost")
        if not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidArgument(f"priority must be an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority!r}")
        number, oid, h = self._parse(key, add=True)
        row, at = self._find(number, oid, h)
        if row >= 0:
            raise InvalidArgument(f"key {key!r} is already tracked; remove it before inserting it again")
        state = size_bytes << SIZE_SHIFT | (priority - MIN_PRIORITY) << PRIORITY_SHIFT
        if self._ghost.take(key):
            state |= IN_MAIN
        row = self._new_row()
        self.ns[row], self.ids[row], self.hash[row], self.state[row] = number, np.frombuffer(oid, np.uint8), h, state
        if self._slots[at] == GONE:
            self._gone -= 1
        self._slots[at] = row
        self._live += 1
        self._tracked_bytes += size_bytes
        if state & IN_MAIN:
            self._main.append(row)
            self._main_bytes += size_bytes
        else:
            self._small.append(row)
            self._small_bytes += size_bytes
        if 2 * (self._live + self._gone) > len(self._slots):
            self._rebuild_slots()

    def _new_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next == len(self.state):
            self._grow(2 * len(self.state))
        self._next += 1
        return self._next - 1

    def _grow(self, rows: int) -> None:
        old = (self.ns, self.ids, self.hash, self.state, self.stale)
        self._columns(rows)
        for new, column in zip((self.ns, self.ids, self.hash, self.state, self.stale), old):
            new[:len(column)] = column

    def on_access(self, key: bytes) -> None:
        row = self._row_of(key)
        if row >= 0 and int(self.state[row]) & FREQ_MASK < MAX_FREQ:
            self.state[row] += 1

    def on_remove(self, key: bytes) -> None:
        parsed = self._parse(key)
        if parsed is None:
            return
        row, at = self._find(*parsed)
        if row < 0:
            return
        state = self._drop(row, at)
        if state & IN_MAIN:
            self._main_bytes -= state >> SIZE_SHIFT
        else:
            self._small_bytes -= state >> SIZE_SHIFT
        self.stale[row] += 1  # its place stays queued: the row waits until it is passed
        self._num_stale += 1
        if self._num_stale > max(4096, self._live):
            self._drop_stale()

    def _drop(self, row: int, at: int) -> int:
        """Untrack a row (its slot becomes GONE); its state is returned."""
        state = int(self.state[row])
        self.state[row] = 0
        self._slots[at] = GONE
        self._gone += 1
        self._live -= 1
        self._tracked_bytes -= state >> SIZE_SHIFT
        return state

    def _slot_of_row(self, row: int) -> int:
        return self._find(int(self.ns[row]), self.ids[row].tobytes(), int(self.hash[row]))[1]

    def victims(self, bytes_needed: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        if bytes_needed <= 0:
            return []
        chosen: list[bytes] = []
        skipped: tuple[list[int], list[int]] = ([], [])  # S's, M's rows stepped over
        freed = 0
        try:
            while freed < bytes_needed:
                from_small = bool(self._small) and (self._small_bytes >= self.small_target_bytes or not self._main)
                if not from_small and not self._main:
                    break
                picked = self._next_candidate(from_small, evictable, skipped[0 if from_small else 1])
                if picked is None:
                    continue
                row, key = picked
                state = self._drop(row, self._slot_of_row(row))
                self._free.append(row)
                size = state >> SIZE_SHIFT
                if from_small:
                    self._small_bytes -= size
                    self._ghost.remember(key, size)
                else:
                    self._main_bytes -= size
                chosen.append(key)
                freed += size
        finally:
            self._small.push_tail(skipped[0])
            self._main.push_tail(skipped[1])
        return chosen

    def _next_candidate(self, from_small: bool, evictable, skipped: list[int]) -> tuple[int, bytes] | None:
        queue, state = (self._small if from_small else self._main), self.state
        while queue:
            row = queue.popleft()
            current = int(state[row])
            if current == 0:  # a removed key's place
                self._passed_stale(row)
                continue
            key = self.key_of(row)
            if not evictable(key):
                skipped.append(row)
                continue
            step = tail_step(from_small, current & FREQ_MASK)
            if step is EVICT:
                return row, key
            if step is PROMOTE:
                size = current >> SIZE_SHIFT
                self._small_bytes -= size
                state[row] = current | IN_MAIN
                self._main.append(row)
                self._main_bytes += size
            else:
                state[row] = current - 1
                queue.append(row)
        return None

    def _passed_stale(self, row: int) -> None:
        self.stale[row] -= 1
        self._num_stale -= 1
        if self.stale[row] == 0:
            self._free.append(row)

    # --- bulk -----------------------------------------------------------------------------

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
        """Put rows into the slots table, which holds no tombstone (open_slots.place); a row
        whose key a placed row has already (a duplicate) is left out of the table and of _live."""
        self._live -= place(self._slots, rows, self._homes(rows), self._twins)

    def _twins(self, occupants: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which rows have the key of the occupant they met."""
        twin = np.zeros(len(rows), bool)
        maybe = np.nonzero(self.hash[occupants] == self.hash[rows])[0]
        if len(maybe):
            twin[maybe] = (self.ns[occupants[maybe]] == self.ns[rows[maybe]]) & \
                (self.ids[occupants[maybe]] == self.ids[rows[maybe]]).all(axis=1)
        return twin

    def _rebuild_slots(self) -> None:
        """A fresh slots table (no tombstones), at most a quarter full."""
        rows = np.nonzero(self.state[:self._next])[0]
        self._slots = np.full(self._slot_count(max(len(self.state), 2 * len(rows))), EMPTY, np.int32)
        self._gone = 0
        self._place(rows)

    def _drop_stale(self) -> None:
        """Rebuild S and M without the places of removed keys; their rows are free again."""
        for ring in (self._small, self._main):
            rows = ring.items()
            ring.replace(rows[self.state[rows] != 0])
        dead = np.nonzero(self.stale[:self._next])[0]
        self.stale[dead] = 0
        self._free.extend(dead.tolist())
        self._num_stale = 0

    def compact(self) -> bool:
        """Give back the columns' room once removals left them sparse (as dicts are rebuilt);
        rows are renumbered. True if it was."""
        if not sparse(self._live, self._next):
            return False
        self._drop_stale()
        keep = np.nonzero(self.state[:self._next])[0]
        renumber = np.full(self._next, -1, np.int64)
        renumber[keep] = np.arange(len(keep))
        old = (self.ns, self.ids, self.hash, self.state)
        self._columns(max(16, 2 * len(keep)))
        for new, column in zip((self.ns, self.ids, self.hash, self.state), old):
            new[:len(keep)] = column[keep]
        for ring in (self._small, self._main):
            ring.replace(renumber[ring.items()].astype(np.int32))
        self._next, self._free = len(keep), []
        self._slots = np.full(self._slot_count(len(self.state)), EMPTY, np.int32)
        self._gone = 0
        self._place(np.arange(len(keep)))
        self._ghost.rebuild()
        return True

    # --- integrity -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first inconsistency: every invariant of the columns,
        slots and queues, vectorised. O(n); the daemon runs it while it indexes few objects."""
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
        if any(key in self for key in self._ghost.sizes):
            raise fail("a tracked key is also in the ghost queue")
        self._ghost.check(fail)

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
