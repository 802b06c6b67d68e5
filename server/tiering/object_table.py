"""A namespace's host index as columns: a row per object, no Python object per entry.

Kept as a dict of Python objects (the id's bytes, an entry, its packed record, the dict's
slot) an indexed object cost ~400 B at 10 M objects. Here an entry is a row of numpy columns
and a slot of an open-addressing table, and an ObjectEntry is a small view (table, row,
serial, id: server/tiering/object_entry.py) made when code asks for an entry and dropped with it:

    ids[row]        32 B     the id; hash[row] uint32: the low bits of Python's hash of it
                             (SipHash, keyed per process: ids are chosen by clients, and cannot
                             be crafted to share a probe chain), compared before the id
    offset          uint32   where the extent starts in the namespace's arena, in 64 B units
                             (slots and pages are 64 B aligned at least); its length is not
                             kept: it is the size's class or, flag PAGED, its whole pages (an
                             object fetched from a pool lands in pages: server/pool/link.py);
                             flag NO_EXTENT: none
    size            uint32   the object's bytes
    serial          uint64   this copy of the object, never reused: a view of a row since
                             given to another object sees another serial and raises StaleEntry
    created_at      float64  wall clock
    expires_at      float64  monotonic, read only where flags has TTL: a row without one never
                             writes it, so while no object of the table has a TTL the column's
                             pages are never touched and take no memory (8 B an object saved)
    checksum[row]   16 B     xxh3-128 of the bytes
    hits uint16 (saturates), readers int32, flags uint8 (INDEXED, DELETED, ON_NVME, TTL,
                             PAGED, NO_EXTENT; USED till released)
    kind            uint16   the row's (descriptor, hints) pair, kept once per table however
                             many rows share it (server/tiering/interned.py); hints that name
                             the object's own blocks (a route) are the row's own: own_hints
    pins            dict     row -> pinned until (monotonic; math.inf: until unpinned), for
                             the pinned rows only: most objects are never pinned
    slots           int32    linear probing: a row, EMPTY, or GONE (a tombstone); at most
                             LOAD full, then rebuilt (vectorised) without tombstones

offset, size and kind widen (offset and size to uint64, kind to uint32) the first time a value
of the table needs it: an arena past 256 GiB, an object of 4 GiB or more, a table with more than
65,536 distinct pairs; most tables never pay for the widths few need.

A row leaves the index (`remove`) and is given back (`release`) once its last reader left:
until then a deleted entry keeps its row, its extent and its fields (extents_still_read).
A released row keeps its fields until it is reused (last released first), so code that reads
a just-removed entry on the same call reads what it read before. Once nothing is left (no
indexed or read row) housekeeping starts the columns again small, and once they are mostly
unused it moves the indexed rows into columns sized for them: memory goes back with the
objects.

The event loop's thread only, like the rest of the host tier.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable

import numpy as np

from kvstore.identity import ID_BYTES, ObjectId, StateDescriptor
from kvstore.policy.base import sparse
from kvstore.server.tiering.interned import Interned
from kvstore.server.tiering.object_entry import (
    CHECKSUM_BYTES, INDEXED, MAX_HITS, NO_EXTENT, OFFSET_SHIFT, ON_NVME, PAGED, TTL, USED, ObjectEntry)
from kvstore.server.tiering.open_slots import EMPTY, GONE, find, place
from kvstore.tiers.allocator import Extent
from kvstore.tiers.arena import PAGE_BYTES
from kvstore.tiers.slabs import footprint

LOAD = 0.7  # the most of the slots rows and tombstones take before a rebuild
MIN_ROWS = 64


class _Serials:
    """Copy serials, never reused (process-wide): one at a time or a block for a batch."""

    def __init__(self):
        self._next = 1

    def take(self, count: int = 1) -> int:
        """The first of `count` new serials (the rest follow it)."""
        first, self._next = self._next, self._next + count
        return first


_SERIALS = _Serials()

HASH_MASK = (1 << 32) - 1  # the bits of an id's hash a row keeps

# (name, dtype, width per row: 0 for a scalar column)
_COLUMNS = (("ids", np.uint8, ID_BYTES), ("hash", np.uint32, 0), ("offset", np.uint32, 0),
            ("size", np.uint32, 0), ("serial", np.uint64, 0),
            ("created_at", np.float64, 0), ("expires_at", np.float64, 0),
            ("checksum", np.uint8, CHECKSUM_BYTES), ("hits", np.uint16, 0), ("readers", np.int32, 0),
            ("flags", np.uint8, 0), ("kind", np.uint16, 0))
_WIDER = {"offset": np.uint64, "size": np.uint64, "kind": np.uint32}  # what a column widens to


def _pages(size):
    """The bytes of the whole pages `size` bytes take (an int, or each of an array's)."""
    return -(-size // PAGE_BYTES) * PAGE_BYTES


def _hashes(ids) -> np.ndarray:
    """The low bits (HASH_MASK) of Python's hash of each id, as a row keeps them."""
    return (np.fromiter(map(hash, ids), np.int64, len(ids)) & HASH_MASK).astype(np.uint32)


def _placed_many(offsets: np.ndarray, lengths: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """ObjectTable._placed's flag for many extents at once (PAGED or 0); any other extent
    (NO_EXTENT included) is a caller's bug."""
    classed = lengths == np.fromiter((footprint(size, PAGE_BYTES) for size in sizes.tolist()), np.int64, len(sizes))
    aligned = offsets & ((1 << OFFSET_SHIFT) - 1) == 0
    if not (aligned & (classed | (lengths == _pages(sizes)))).all():
        raise ValueError("an extent is not where the arena puts its object: 64 B aligned, its size class or "
                         "its whole pages")
    return np.where(classed, 0, PAGED).astype(np.uint8)


class ObjectTable:
    """One namespace's committed objects (see above); a mapping id -> ObjectEntry to read."""

    def __init__(self, name: str):
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self.end = 0  # rows below it have been used (entries read it: their row is below it)
        self._in_use = 0  # rows indexed or still read
        self._live = self._gone = 0  # rows in the slots; tombstones in the slots
        self._free = array("i")
        self.kinds = Interned()  # (descriptor, hints) pairs; every row below `end` refers to one
        self.own_hints: dict[int, object] = {}  # row -> hints with a route (each object's own)
        self.pins: dict[int, float] = {}
        self._ttls = False  # an object of the table had a TTL: expires_at's pages are in use
        self._dtypes = {name: dtype for name, dtype, _ in _COLUMNS}  # (narrow again)
        self._columns(MIN_ROWS, 0)
        self._new_slots(MIN_ROWS)

    def _columns(self, rows: int, keep: int) -> None:
        """Columns of `rows` rows, the first `keep` copied over; a memoryview of each, whose
        items read and write as Python ints and floats (a numpy scalar costs ~3x)."""
        for name, _, width in _COLUMNS:
            column = np.zeros((rows, width) if width else rows, self._dtypes[name])
            if keep and self._copied(name):
                column[:keep] = getattr(self, "c_" + name)[:keep]
            self._set_column(name, column)

    def _set_column(self, name: str, column: np.ndarray) -> None:
        setattr(self, "c_" + name, column)
        setattr(self, "m_" + name, memoryview(column).cast("B") if column.ndim == 2 else memoryview(column))

    def _widen(self, **values: int) -> None:
        """Widen each column named whose dtype cannot hold its value (once per table and column)."""
        for name, value in values.items():
            if value > np.iinfo(self._dtypes[name]).max:
                self._dtypes[name] = _WIDER[name]
                self._set_column(name, getattr(self, "c_" + name).astype(_WIDER[name]))

    def _copied(self, name: str) -> bool:
        """Does a move to new columns copy column `name`? Not expires_at while no object of the
        table had a TTL: it is all zeros, and new columns' pages left untouched take no memory."""
        return self._ttls or name != "expires_at"

    def _new_slots(self, count: int) -> None:
        self.c_slots = np.full(count, EMPTY, np.int32)
        self.m_slots = memoryview(self.c_slots)
        self._mask = count - 1
        self._gone = 0

    # --- the mapping ---------------------------------------------------------------------

    def __len__(self) -> int:
        return self._live

    def __contains__(self, oid) -> bool:
        return self._find(oid, hash(oid) & HASH_MASK)[0] >= 0

    def get(self, oid, default=None) -> ObjectEntry | None:
        row = self._find(oid, hash(oid) & HASH_MASK)[0]
        if row < 0:
            return default
        return ObjectEntry(self, row, self.m_serial[row], oid if type(oid) is ObjectId else ObjectId(oid))

    def __getitem__(self, oid) -> ObjectEntry:
        entry = self.get(oid)
        if entry is None:
            raise KeyError(oid)
        return entry

    def live_rows(self, ids, now: float) -> np.ndarray:
        """The row of each of many ids (raw 32-byte ids or ObjectIds) indexed and not past its
        TTL at `now`, -1 for the others: probed all at once (a batch's lookup), not an id at a
        time."""
        rows = self.held_rows(ids)
        held = rows >= 0
        if self._ttls:
            live = rows[held]
            held[held] = (self.c_flags[live] & TTL == 0) | (self.c_expires_at[live] > now)
        rows[~held] = -1
        return rows

    def rows_of(self, ids, hashes: np.ndarray) -> np.ndarray:
        """The indexed row of each of many ids (-1: none), past its TTL or not; hashes: theirs
        (_hashes)."""
        if not self._live or not len(ids):
            return np.full(len(ids), -1, np.int64)
        wanted = np.frombuffer(b"".join(ids), np.uint64).reshape(len(ids), ID_BYTES // 8)
        words = self.c_ids.view(np.uint64)  # an id as four words: compared 8 bytes at a time

        def matches(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
            same = self.c_hash[rows] == hashes[keys]
            rows, keys = rows[same], keys[same]
            same[same] = (words[rows] == wanted[keys]).all(axis=1)
            return same
        return find(self.c_slots, hashes & np.uint32(self._mask), matches,
                    lambda key: self._find(ids[key], int(hashes[key]))[0])

    def held_rows(self, ids) -> np.ndarray:
        """The indexed row of each of many ids (-1: none), past its TTL or not."""
        return self.rows_of(ids, _hashes(ids))

    def add_hits(self, rows: np.ndarray, times: np.ndarray) -> int:
        """times[k] hits on rows[k] (distinct rows), capped as num_hits is; the bytes of the
        objects hit, one object's size per hit."""
        self.c_hits[rows] = np.minimum(self.c_hits[rows] + times, MAX_HITS)
        return int((self.c_size[rows].astype(np.int64) * times).sum())

    def first_indexed(self, oids: list) -> int:
        """The index of the first of `oids` indexed here (past its TTL or not); len(oids) if none is."""
        held = np.flatnonzero(self.held_rows(oids) >= 0)
        return int(held[0]) if len(held) else len(oids)

    def placements(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte offsets in the arena, sizes) of the objects on `rows`."""
        return self.c_offset[rows].astype(np.uint64) << np.uint64(OFFSET_SHIFT), self.c_size[rows]

    def entry_on(self, row: int, oid: ObjectId) -> ObjectEntry:
        """The entry on a row live_rows found for `oid` (read before anything changed it)."""
        return ObjectEntry(self, row, self.m_serial[row], oid)

    def entry_at(self, row: int) -> ObjectEntry:
        """The entry on a used row (the eviction policy's keys are rows)."""
        return ObjectEntry(self, row, self.m_serial[row], ObjectId(bytes(self.m_ids[row * ID_BYTES:(row + 1) * ID_BYTES])))

    def idle(self, row: int, now: float) -> bool:
        """Neither read nor pinned at `now`: the row's object may be evicted."""
        return self.m_readers[row] == 0 and self.pins.get(row, 0.0) <= now

    def indexed_rows(self) -> np.ndarray:
        """The indexed rows, ascending."""
        return np.nonzero(self.c_flags[:self.end] & INDEXED)[0]

    def _indexed_rows(self) -> tuple[np.ndarray, np.ndarray]:
        rows = self.indexed_rows()
        return rows, self.c_serial[rows]

    def _indexed(self):
        """(row, serial, id) of each indexed object; one removed meanwhile is skipped."""
        rows, serials = self._indexed_rows()
        for row, serial in zip(rows.tolist(), serials.tolist()):
            if row < self.end and self.m_serial[row] == serial and self.m_flags[row] & INDEXED:
                yield row, serial, ObjectId(bytes(self.m_ids[row * ID_BYTES:(row + 1) * ID_BYTES]))

    def items(self):
        return ((oid, ObjectEntry(self, row, serial, oid)) for row, serial, oid in self._indexed())

    def values(self):
        return (ObjectEntry(self, row, serial, oid) for row, serial, oid in self._indexed())

    def __iter__(self):
        return (oid for _, _, oid in self._indexed())

    keys = __iter__

    def holds(self, entry: ObjectEntry | None) -> bool:
        """Is `entry` this table's indexed copy of its id (not removed, not replaced)?"""
        if entry is None or entry.table is not self:
            return False
        row = entry.row
        if not (row < self.end and self.m_serial[row] == entry.serial):
            row = self.moved_row(entry)
        return row >= 0 and bool(self.m_flags[row] & INDEXED)

    def moved_row(self, entry: ObjectEntry) -> int:
        """The row an indexed entry moved to when the table was compacted (-1: it left)."""
        row = self._find(entry.object_id, hash(entry.object_id) & HASH_MASK)[0]
        if row < 0 or self.m_serial[row] != entry.serial:
            return -1
        entry.row = row
        return row

    def _find(self, oid, h: int) -> tuple[int, int]:
        """(row, its slot) of an indexed id (h: its hash's low bits, HASH_MASK), or (-1, the
        slot an insert takes)."""
        slots, hashes, ids, mask = self.m_slots, self.m_hash, self.m_ids, self._mask
        at, free = h & mask, -1
        while True:
            row = slots[at]
            if row == EMPTY:
                return -1, (at if free < 0 else free)
            if row == GONE:
                if free < 0:
                    free = at
            elif hashes[row] == h and ids[row * ID_BYTES:(row + 1) * ID_BYTES] == oid:
                return row, at
            at = (at + 1) & mask

    # --- changes ------------------------------------------------------------------------

    def add(self, oid: ObjectId, extent: Extent | None, size: int, checksum: bytes, descriptor, hints,
            now: float, created_at: float | None = None, pin: bool = False, on_nvme: bool = False) -> ObjectEntry:
        """Index a new copy of `oid` (not indexed here: the host tier replaces a copy by removing
        it first). It expires hints.ttl_s after its put (`now`, monotonic, for a new one; for a
        copy of an older object, `created_at` on the wall clock: a TTL counts from the put on
        every tier), and is pinned until unpinned when `pin`."""
        if len(checksum) != CHECKSUM_BYTES:
            raise ValueError(f"an entry's checksum is {CHECKSUM_BYTES} bytes, got {len(checksum)}")
        oid = ObjectId(oid)
        h = hash(oid) & HASH_MASK
        row, at = self._find(oid, h)
        if row >= 0:
            raise RuntimeError(f"object {oid.hex} is indexed already in namespace {self.name}")
        wall = time.time()
        ttl = 0
        if hints.ttl_s is not None:
            ttl, self._ttls = TTL, True
            expires_at = now + hints.ttl_s - (0.0 if created_at is None else max(0.0, wall - created_at))
        units, fit = self._placed(extent, size)
        row = self._new_row()
        if hints.route is None:
            kind = self.kinds.ref((descriptor, hints))
            if self.own_hints:
                self.own_hints.pop(row, None)  # the row's last object's
        else:
            kind = self.kinds.ref((descriptor, None))
            self.own_hints[row] = hints
        if (units | size) >> 32 or kind >> 16:
            self._widen(offset=units, size=size, kind=kind)
        serial = _SERIALS.take()
        self.m_ids[row * ID_BYTES:(row + 1) * ID_BYTES] = oid
        self.m_checksum[row * CHECKSUM_BYTES:(row + 1) * CHECKSUM_BYTES] = checksum
        self.m_hash[row], self.m_serial[row], self.m_size[row], self.m_offset[row] = h, serial, size, units
        self.m_created_at[row] = wall if created_at is None else created_at
        if ttl:
            self.m_expires_at[row] = expires_at
        if pin:
            self.pins[row] = math.inf
        else:
            self.pins.pop(row, None)  # the row's last object's, if it was pinned
        self.m_hits[row] = self.m_readers[row] = 0
        self.m_flags[row] = USED | INDEXED | (ON_NVME if on_nvme else 0) | ttl | fit
        self.m_kind[row] = kind
        if self.m_slots[at] == GONE:
            self._gone -= 1
        self.m_slots[at] = row
        self._live += 1
        if self._live + self._gone > LOAD * len(self.c_slots):
            self._rebuild_slots()
        return ObjectEntry(self, row, serial, oid)

    def add_many(self, oids: list, extents: list, sizes: list, checksums: bytes, descriptor, hints,
                 now: float) -> tuple[np.ndarray, int]:
        """Index many new copies at once, a batch's plain case: distinct ids none of which is
        indexed here (the caller cuts its batch at first_indexed), all under one (descriptor,
        hints) pair that names no route and no TTL, none pinned or on NVMe (add says what
        each field means); anything else raises before a row changes. The rows are taken as
        add takes them, their columns written as arrays, and the ids placed in the slots
        together. checksums: theirs, joined. Returns (their rows in order, the first row's
        serial: the others' follow it)."""
        count = len(oids)
        if not count:
            return np.zeros(0, np.int64), 0
        if hints.route is not None or hints.ttl_s is not None or len(checksums) != CHECKSUM_BYTES * count:
            raise ValueError("add_many takes objects without a route or TTL, and a checksum each")
        hashes = _hashes(oids)
        if len(set(oids)) != count or (self.rows_of(oids, hashes) >= 0).any():
            raise RuntimeError(f"add_many: an id is indexed already in namespace {self.name}, or named twice")
        offsets = np.fromiter((e.offset for e in extents), np.int64, count)
        lengths = np.fromiter((e.length for e in extents), np.int64, count)
        size = np.asarray(sizes, np.int64)
        fit = _placed_many(offsets, lengths, size)
        units = offsets >> OFFSET_SHIFT
        rows = self._new_rows(count)
        kind = self.kinds.ref((descriptor, hints), count)
        if (int(units.max()) | int(size.max())) >> 32 or kind >> 16:
            self._widen(offset=int(units.max()), size=int(size.max()), kind=kind)
        serial = _SERIALS.take(count)
        self.c_ids[rows] = np.frombuffer(b"".join(oids), np.uint8).reshape(count, ID_BYTES)
        self.c_checksum[rows] = np.frombuffer(checksums, np.uint8).reshape(count, CHECKSUM_BYTES)
        self.c_hash[rows], self.c_serial[rows] = hashes, np.arange(serial, serial + count, dtype=np.uint64)
        self.c_size[rows], self.c_offset[rows] = size, units
        self.c_created_at[rows] = time.time()
        for row in rows.tolist() if self.pins or self.own_hints else ():  # reused rows' last objects'
            self.pins.pop(row, None)
            self.own_hints.pop(row, None)
        self.c_hits[rows] = self.c_readers[rows] = 0
        self.c_flags[rows] = USED | INDEXED | fit
        self.c_kind[rows] = kind
        self._live += count
        if self._live + self._gone > LOAD * len(self.c_slots):
            self._rebuild_slots()  # (places the new rows with the rest)
        else:
            place(self.c_slots, rows.astype(np.int32), hashes & np.uint32(self._mask))
        return rows, serial

    @staticmethod
    def _placed(extent: Extent | None, size: int) -> tuple[int, int]:
        """(offset in 64 B units, PAGED / NO_EXTENT / 0) of an entry's extent: what the row
        keeps to give the extent back whole (extent_at). Any other extent is a caller's bug."""
        if extent is None:
            return 0, NO_EXTENT
        offset, length = extent.offset, extent.length
        if not offset & ((1 << OFFSET_SHIFT) - 1):
            if length == footprint(size, PAGE_BYTES):
                return offset >> OFFSET_SHIFT, 0
            if length == _pages(size):
                return offset >> OFFSET_SHIFT, PAGED
        raise ValueError(f"{extent!r} is not where the arena puts {size} bytes: 64 B aligned, their "
                         f"size class or their whole pages")

    def extent_at(self, row: int) -> Extent | None:
        """The extent of a row's object, as the arena handed it out (None: it has none)."""
        flags, size = self.m_flags[row], self.m_size[row]
        if flags & NO_EXTENT:
            return None
        length = _pages(size) if flags & PAGED else footprint(size, PAGE_BYTES)
        return Extent(self.m_offset[row] << OFFSET_SHIFT, length)

    def _new_row(self) -> int:
        self._in_use += 1
        if self._free:
            row = self._free.pop()
            self.kinds.unref(self.m_kind[row])  # the fields of the row's last object go now
            return row
        if self.end == len(self.c_flags):
            self._columns(2 * self.end, self.end)
        self.end += 1
        return self.end - 1

    def _new_rows(self, count: int) -> np.ndarray:
        """`count` rows for new objects, as _new_row takes them one at a time (the last
        released first, then new ones past `end`)."""
        reused = min(count, len(self._free))
        taken = np.array(self._free[len(self._free) - reused:][::-1], np.int64)
        del self._free[len(self._free) - reused:]
        for kind in self.c_kind[taken].tolist():
            self.kinds.unref(kind)  # the fields of the rows' last objects go now
        fresh = count - reused
        if self.end + fresh > len(self.c_flags):
            self._columns(max(2 * self.end, self.end + fresh), self.end)
        self.end += fresh
        self._in_use += count
        return np.concatenate([taken, np.arange(self.end - fresh, self.end)])

    def remove(self, entry: ObjectEntry) -> None:
        """Take an indexed entry out of the index; its row stays until `release`."""
        if not self.holds(entry):
            raise RuntimeError(f"{entry!r} is not indexed in namespace {self.name}")
        row, at = self._find(entry.object_id, self.m_hash[entry.row])
        self.m_slots[at] = GONE
        self._gone += 1
        self._live -= 1
        self.m_flags[row] &= ~INDEXED

    def release(self, entry: ObjectEntry) -> None:
        """Give back a removed entry's row (its last reader left). Its fields stay readable
        until another object takes the row."""
        row = entry.locate()
        if self.m_flags[row] & INDEXED or self.m_readers[row]:
            raise RuntimeError(f"{entry!r} is still indexed or read: its row cannot be released")
        self.m_flags[row] &= ~USED
        self._in_use -= 1
        self._free.append(row)

    def _rebuild_slots(self) -> None:
        """Fresh slots without tombstones, at most half full; every indexed row placed."""
        rows = np.nonzero(self.c_flags[:self.end] & INDEXED)[0].astype(np.int32)
        count = MIN_ROWS
        while count < 2 * len(rows):
            count *= 2
        self._new_slots(count)
        place(self.c_slots, rows, self.c_hash[rows] & self._mask)  # the index holds no twins

    def compact(self, moved: Callable[[np.ndarray], None]) -> bool:
        """Housekeeping: once removals left the columns mostly unused, move the indexed rows
        to new columns sized for them (an entry's view finds its new row by its id: moved_row);
        rows still read after their entry left (zombies) are never moved, so the columns wait
        for their readers. Else rebuild the slots once tombstones are most of them. True if
        anything was rebuilt. `moved(keep)` learns of each move: row keep[i] is row i now
        (keep empty: the table started over)."""
        if not self._in_use:
            if self.end <= MIN_ROWS:
                return False
            self._reset()
            moved(np.zeros(0, np.intp))
            return True
        if self._in_use == self._live and sparse(self._live, len(self.c_flags)):
            keep = np.nonzero(self.c_flags[:self.end] & INDEXED)[0]
            old = {name: getattr(self, "c_" + name) for name, _, _ in _COLUMNS}
            self._columns(max(MIN_ROWS, 2 * len(keep)), 0)
            for name, column in old.items():
                if self._copied(name):
                    getattr(self, "c_" + name)[:len(keep)] = column[keep]
            self.kinds.recount(self.c_kind[:len(keep)])
            self.pins, self.own_hints = _renumbered(self.pins, keep), _renumbered(self.own_hints, keep)
            self.end, self._free = len(keep), array("i")
            self._rebuild_slots()
            moved(keep)
            return True
        if self._gone <= max(MIN_ROWS, self._live):
            return False
        self._rebuild_slots()
        return True

    # --- whole-table reads ------------------------------------------------------------------

    def descriptor_at(self, row: int) -> StateDescriptor:
        return self.kinds.values[self.m_kind[row]][0]

    def hints_at(self, row: int):
        hints = self.kinds.values[self.m_kind[row]][1]
        return self.own_hints[row] if hints is None else hints

    @property
    def nbytes(self) -> int:
        """What the columns and slots take (allocated; pages never written are not resident)."""
        return sum(getattr(self, "c_" + name).nbytes for name, _, _ in _COLUMNS) + self.c_slots.nbytes

    def extents_still_read(self) -> list[Extent]:
        """The extents of entries removed from the index while read (kept until their last
        reader leaves: `release`)."""
        flags = self.c_flags[:self.end]
        rows = np.nonzero((flags & (USED | INDEXED | NO_EXTENT)) == USED)[0]
        return [self.extent_at(row) for row in rows.tolist()]

    def total_readers(self) -> int:
        """Readers counted on every row, deleted ones still read included."""
        return int(self.c_readers[:self.end].sum())

    def num_pinned(self, now: float) -> int:
        flags = self.m_flags
        return sum(1 for row, until in self.pins.items() if until > now and flags[row] & INDEXED)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the slots, the flags and the counts disagree."""
        flags = self.c_flags[:self.end]
        indexed = np.nonzero(flags & INDEXED)[0]
        used = flags & USED != 0
        if len(indexed) != self._live or int(used.sum()) != self._in_use:
            raise RuntimeError(f"object table {self.name}: {len(indexed)} rows indexed / {int(used.sum())} "
                               f"in use, counted {self._live} / {self._in_use}")
        held = self.c_slots[self.c_slots >= 0]
        if len(held) != self._live or set(held.tolist()) != set(indexed.tolist()):
            raise RuntimeError(f"object table {self.name}: the slots do not hold each indexed row once")
        if int((self.c_slots == GONE).sum()) != self._gone:
            raise RuntimeError(f"object table {self.name}: {self._gone} tombstones counted")
        free = set(self._free.tolist())
        if len(free) != len(self._free) or free != set(np.nonzero(~used)[0].tolist()):
            raise RuntimeError(f"object table {self.name}: the free rows are not exactly the unused rows")
        self.kinds.check_integrity(self.c_kind[:self.end])
        if any(row >= self.end or self.kinds.values[self.m_kind[row]][1] is not None for row in self.own_hints):
            raise RuntimeError(f"object table {self.name}: a row with hints of its own also shares a pair's")
        for row in indexed.tolist():
            if self._find(bytes(self.m_ids[row * ID_BYTES:(row + 1) * ID_BYTES]), self.m_hash[row])[0] != row:
                raise RuntimeError(f"object table {self.name}: row {row} cannot be found from its id")


def lone_entry(object_id: ObjectId, namespace: str, extent, size: int, checksum: bytes,
               descriptor: StateDescriptor, hints, now: float, created_at: float | None = None,
               pin: bool = False, on_nvme: bool = False) -> ObjectEntry:
    """An entry in a table of its own (tests, tools); the host tier adds to its namespace's
    table (ObjectTable.add, which says what each field means)."""
    return ObjectTable(namespace).add(object_id, extent, size, checksum, descriptor, hints, now,
                                      created_at=created_at, pin=pin, on_nvme=on_nvme)


def _renumbered(by_row: dict, keep: np.ndarray) -> dict:
    """`by_row`'s values under their rows' new numbers (row keep[i] is row i now), the rows not
    kept left out. Most tables are empty: nothing of the million rows kept is made in Python."""
    if not by_row or not len(keep):
        return {}
    rows = np.fromiter(by_row, np.int64, len(by_row))
    at = np.searchsorted(keep, rows)  # keep is sorted
    found = (at < len(keep)) & (keep[np.minimum(at, len(keep) - 1)] == rows)
    return {new: by_row[old] for old, new, kept in zip(rows.tolist(), at.tolist(), found.tolist()) if kept}
