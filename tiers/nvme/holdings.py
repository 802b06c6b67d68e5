"""What the NVMe index holds after a restart, gathered in recovery's one scan of it, for the
daemon's own index of NVMe objects (server/tiering/nvme_table.py, built by TierMover.open).

Building that index from `NvmeTier.list()` decoded every record (descriptor and hints
included) and kept all of them at once: about 15 us and 1 KB of daemon memory per object,
150 s and 10 GB for 10 M objects. Then a Python object per key (its index key, kept from the
scan) still cost ~190 B per object and, with hashed ids (whose age order is not index order),
~16 s of a 10 M-object start in dict and queue building that walked those objects in random
order. Here recovery keeps columns only, and the daemon's index is built from them in numpy:

    key     u16_be(len(ns)) || ns || 32-byte id   (tiers/nvme/index.py), kept as the number
            of its prefix (u16 length and namespace; `prefixes`) and the id's 32 bytes
    size    the record head's fixed-width size
    created the record's last field: msgpack float64, 0xcb then 8 bytes big-endian; records
            are written with created_at last (NvmeRecord.encode). A tail that is not one
            reads as 0.0 (oldest).
    deadline created_at + hints.ttl_s, only for the few records put with a TTL: found by one
            search of the chunk's joined records for the hint's name, then decoded one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.identity import ID_BYTES
from kvstore.tiers.nvme.index import NvmeRecord

_TAIL = 9  # 0xcb, then the float64
_FLOAT64 = 0xCB


def lengths_of(parts: list[bytes]) -> np.ndarray:
    """len() of each part, as int64 (recovery takes each chunk's once, for every check)."""
    return np.fromiter(map(len, parts), np.int64, len(parts))


_TTL = b"ttl_s"  # the hint's name as msgpack writes it into a record (Hints.to_wire)


def created_at_of(values: list[bytes], lengths: np.ndarray | None = None, joined: bytes | None = None) -> np.ndarray:
    """created_at of each record (wall clock seconds; 0.0 where unreadable): one join and one
    gather, no Python object per record. lengths: lengths_of(values), and joined:
    b"".join(values), if the caller has them."""
    lengths = lengths_of(values) if lengths is None else lengths
    joined = np.frombuffer(b"".join(values) if joined is None else joined, np.uint8)
    if len(joined) < _TAIL:  # too short to hold one tail: reads as none
        joined = np.concatenate([joined, np.zeros(_TAIL, np.uint8)])
    raw = joined[np.maximum(np.cumsum(lengths) - _TAIL, 0)[:, None] + np.arange(_TAIL)]
    times = np.ascontiguousarray(raw[:, 1:]).view(">f8").reshape(-1).astype(np.float64)
    good = (raw[:, 0] == _FLOAT64) & np.isfinite(times) & (lengths >= _TAIL)
    return np.where(good, times, 0.0)


def deadlines_of(keys: list[bytes], values: list[bytes], joined: bytes) -> dict[bytes, float]:
    """{key: created_at + ttl_s} of the records put with a TTL (usually none: one search)."""
    if _TTL not in joined:
        return {}
    found = {}
    for key, value in zip(keys, values):
        if _TTL in value:
            try:
                record = NvmeRecord.decode(value)
                ttl = record.hints.get("ttl_s")
                if ttl is not None:
                    found[key] = record.created_at + float(ttl)
            except (ValueError, TypeError):  # recovery checked these records; unreadable hints: none
                pass
    return found


def split_keys(keys: list[bytes], prefixes: dict[bytes, int],
               lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prefix numbers as uint16, ids as (n, 32) uint8) of well-formed index keys; a prefix
    not yet in `prefixes` gets the next number. Vectorised: one join, one gather per length.
    lengths: lengths_of(keys), if the caller has it."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.uint16), np.zeros((0, ID_BYTES), np.uint8)
    lengths = lengths_of(keys) if lengths is None else lengths
    joined = np.frombuffer(b"".join(keys), np.uint8)
    width = int(lengths[0])
    if (lengths == width).all():  # the usual chunk: keys of one namespace
        rows = joined.reshape(n, width)
        heads = rows[:, :width - ID_BYTES]
        if (heads == heads[0]).all():
            return np.full(n, prefix_number(prefixes, heads[0].tobytes()), np.uint16), rows[:, width - ID_BYTES:].copy()
    ends = np.cumsum(lengths)
    ids = joined[(ends - ID_BYTES)[:, None] + np.arange(ID_BYTES)]
    numbers = np.empty(n, np.uint16)
    for width in np.unique(lengths).tolist():  # one prefix length per namespace name length
        rows = np.nonzero(lengths == width)[0]
        starts = ends[rows] - width
        heads = joined[starts[:, None] + np.arange(width - ID_BYTES)]
        distinct, inverse = np.unique(heads.view(f"V{width - ID_BYTES}").reshape(-1), return_inverse=True)
        numbers[rows] = np.array([prefix_number(prefixes, p) for p in distinct.tolist()], np.uint16)[inverse.reshape(-1)]
    return numbers, ids


def prefix_number(prefixes: dict[bytes, int], prefix: bytes) -> int:
    """The number of an index key prefix in `prefixes`; a new one gets the next (16 bits)."""
    number = prefixes.get(prefix)
    if number is None:
        if len(prefixes) >= 1 << 16:
            raise InvalidArgument("more than 65,536 namespaces on one NVMe tier")
        number = prefixes[prefix] = len(prefixes)
    return number


def index_keys(prefixes: list[bytes], numbers: np.ndarray, ids: np.ndarray) -> list[bytes]:
    """The index keys of rows given as prefix numbers (into `prefixes`) and (n, 32) ids."""
    heads = [prefixes[i] for i in numbers.tolist()]
    return [p + i for p, i in zip(heads, np.ascontiguousarray(ids).view(f"V{ID_BYTES}").reshape(-1).tolist())]


@dataclass(slots=True)
class Holdings:
    """Columns of every object kept, in index order. The two large ones stay in the chunks the
    scan made: the daemon's table copies them once into its own columns."""

    prefixes: list[bytes]  # index key prefixes (u16 length, namespace), by number
    namespaces: list[np.ndarray]  # chunks of uint16: each object's prefix number
    ids: list[np.ndarray]  # chunks of (n, 32) uint8: each object's id
    sizes: np.ndarray  # int64, one per object
    created_at: np.ndarray  # float64 wall clock, one per object
    deadlines: dict[bytes, float] = field(default_factory=dict)  # index key -> expiry (wall clock)

    def __len__(self) -> int:
        return len(self.sizes)

    def age_order(self) -> np.ndarray:
        """Indexes of the objects, oldest first: the order an eviction policy should learn them
        in. Times are ranked on 2^32 steps of their span (a year's span: 7 ms steps) with two
        16-bit radix sorts; index order breaks ties. 10 M random times: 0.9 s, where sorting
        the floats took 2.2."""
        times = self.created_at
        if len(times) == 0 or times.min() == times.max():
            return np.arange(len(times))
        low = times.min()
        steps = np.minimum((times - low) * ((2**32 - 1) / (times.max() - low)), 2**32 - 1).astype(np.uint32)
        order = np.argsort((steps & 0xFFFF).astype(np.uint16), kind="stable")
        return order[np.argsort((steps[order] >> 16).astype(np.uint16), kind="stable")]

    def keys(self, rows: np.ndarray | None = None) -> list[bytes]:
        """The index keys of the objects at `rows` (default: all, in index order)."""
        rows = np.arange(len(self)) if rows is None else np.asarray(rows, np.int64)
        if len(rows) == 0:
            return []
        return index_keys(self.prefixes, np.concatenate(self.namespaces)[rows], np.concatenate(self.ids)[rows])

    def by_age(self) -> tuple[list[bytes], list[int]]:
        """(index keys, sizes), oldest first (what tests and tools read)."""
        order = self.age_order()
        return self.keys(order), self.sizes[order].tolist()

    def without(self, dropped: set[bytes]) -> Holdings:
        """These holdings less the objects whose keys are in `dropped` (a few, usually none)."""
        known = dict(zip(self.prefixes, range(len(self.prefixes))))
        dropped = [key for key in dropped if len(key) > 2 + ID_BYTES and key[:-ID_BYTES] in known]  # held ones
        if not dropped:
            return self
        gone_keys = set(dropped)
        numbers, ids = split_keys(dropped, known)
        # Candidates by the ids' first 8 bytes, then compared whole.
        heads = np.concatenate([chunk[:, :8] for chunk in self.ids]).view(np.uint64).reshape(-1)
        maybe = np.nonzero(np.isin(heads, ids[:, :8].copy().view(np.uint64).reshape(-1)))[0].tolist()
        gone = set(zip(numbers.tolist(), map(bytes, ids)))
        all_numbers, all_ids = np.concatenate(self.namespaces), np.concatenate(self.ids)
        out = [row for row in maybe if (int(all_numbers[row]), all_ids[row].tobytes()) in gone]
        kept = np.ones(len(self), bool)
        kept[out] = False
        deadlines = {key: at for key, at in self.deadlines.items() if key not in gone_keys}
        return Holdings(self.prefixes, [all_numbers[kept]], [all_ids[kept]], self.sizes[kept], self.created_at[kept],
                        deadlines)


class HoldingsBuilder:
    """Recovery adds each chunk's good records; `build` leaves out what it dropped later."""

    def __init__(self):
        self._prefixes: dict[bytes, int] = {}
        self._namespaces: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._sizes: list[np.ndarray] = []
        self._created: list[np.ndarray] = []
        self._deadlines: dict[bytes, float] = {}

    def add(self, keys: list[bytes], values: list[bytes], key_lengths: np.ndarray, value_lengths: np.ndarray,
            goods: np.ndarray, sizes: np.ndarray) -> None:
        """goods: indexes of the good records in keys/values; sizes: their sizes. The lengths
        are lengths_of(keys) and lengths_of(values), which recovery has already."""
        if len(goods) != len(keys):
            picked = goods.tolist()
            keys, values = [keys[i] for i in picked], [values[i] for i in picked]
            key_lengths, value_lengths = key_lengths[goods], value_lengths[goods]
        numbers, ids = split_keys(keys, self._prefixes, key_lengths)
        self._namespaces.append(numbers)
        self._ids.append(ids)
        self._sizes.append(np.asarray(sizes, dtype=np.int64))
        joined = b"".join(values)
        self._created.append(created_at_of(values, value_lengths, joined))
        self._deadlines.update(deadlines_of(keys, values, joined))

    def build(self, dropped: set[bytes]) -> Holdings:
        """The holdings, without the keys in `dropped` (records recovery dropped after the scan)."""
        held = Holdings(list(self._prefixes), self._namespaces, self._ids,
                        np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int64),
                        np.concatenate(self._created) if self._created else np.zeros(0, np.float64),
                        self._deadlines)
        self.__init__()
        return held.without(dropped)
