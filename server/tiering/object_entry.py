"""An entry of the host index: a view (table, row, serial, id) of its row in a namespace's
ObjectTable (server/tiering/object_table.py, which lays out the columns), made when code asks
for an entry and dropped with it; and what a row's fields mean to the view that reads them.
"""

from __future__ import annotations

import functools
import math

from kvstore.identity import ObjectId, StateDescriptor
from kvstore.replies import GetReply
from kvstore.tiers.allocator import Extent

CHECKSUM_BYTES = 16  # xxh3-128
# flags; USED: indexed or still read; PAGED: the extent is the size's whole pages, not its class
INDEXED, DELETED, ON_NVME, USED, TTL, PAGED, NO_EXTENT = 1, 2, 4, 8, 16, 32, 64
MAX_HITS = (1 << 16) - 1
OFFSET_SHIFT = 6  # offsets are kept in 64 B units


class StaleEntry(RuntimeError):
    """An entry read after its row went to another object: a bug in the reader."""


def _column(name: str, doc: str, cap: int | None = None) -> property:
    """A mutable field of an entry: its row's item in the table's column `name`."""
    def get(self):
        return getattr(self.table, name)[self.locate()]

    def set(self, value) -> None:
        getattr(self.table, name)[self.locate()] = value if cap is None else min(value, cap)
    return property(get, set, doc=doc)


class ObjectEntry:
    """A committed, immutable object in the host tier: a view of its row in the namespace's
    ObjectTable. The mutable fields are bookkeeping only."""

    __slots__ = ("table", "row", "serial", "object_id")

    def __init__(self, table, row: int, serial: int, object_id: ObjectId):
        """table: the namespace's ObjectTable (server/tiering/object_table.py)."""
        self.table, self.row, self.serial, self.object_id = table, row, serial, object_id

    def locate(self) -> int:
        """Its row in the table now (moved by a compaction, found by its id); StaleEntry once
        the row went to another object: the entry left the index and was read after."""
        table, row = self.table, self.row
        if row < table.end and table.m_serial[row] == self.serial:
            return row
        row = table.moved_row(self)
        if row < 0:
            raise StaleEntry(f"entry {self.object_id.hex} (serial {self.serial}) was read after its row "
                             f"in namespace {table.name} went to another object")
        return row

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectEntry) and other.serial == self.serial

    def __hash__(self) -> int:
        return hash(self.serial)

    def __repr__(self) -> str:
        return (f"ObjectEntry({self.object_id}, namespace={self.namespace!r}, serial={self.serial}, "
                f"row={self.row})")

    @property
    def namespace(self) -> str:
        return self.table.name

    @property
    def extent(self) -> Extent | None:
        """Where the bytes are in the namespace's arena: equal (not the same object) each time."""
        return self.table.extent_at(self.locate())

    @property
    def offset(self) -> int:
        return self.table.m_offset[self.locate()] << OFFSET_SHIFT

    @property
    def size(self) -> int:
        return self.table.m_size[self.locate()]

    @property
    def created_at(self) -> float:
        """Wall clock, for listings."""
        return self.table.m_created_at[self.locate()]

    @property
    def checksum(self) -> bytes:
        row = self.locate()
        return bytes(self.table.m_checksum[row * CHECKSUM_BYTES:(row + 1) * CHECKSUM_BYTES])

    @property
    def descriptor(self) -> StateDescriptor:
        return self.table.descriptor_at(self.locate())

    @property
    def hints(self):
        return self.table.hints_at(self.locate())

    @property
    def descriptor_wire(self) -> dict:
        """descriptor.to_wire(), shared by equal descriptors: every get sends it."""
        return _wire_of(self.descriptor)

    def _flag(self, bit: int) -> bool:
        return bool(self.table.m_flags[self.locate()] & bit)

    def _set_flag(self, bit: int, on: bool) -> None:
        row, flags = self.locate(), self.table.m_flags
        flags[row] = flags[row] | bit if on else flags[row] & ~bit

    deleted = property(lambda self: self._flag(DELETED), lambda self, on: self._set_flag(DELETED, on),
                       doc="removed from the index, extent freed when the last reader leaves")
    on_nvme = property(lambda self: self._flag(ON_NVME), lambda self, on: self._set_flag(ON_NVME, on),
                       doc="a verified copy is on the NVMe tier too")

    readers = _column("m_readers", "Read leases and daemon holds on this entry.")
    num_hits = _column("m_hits", "Hits served (capped at 2**16 - 1).", MAX_HITS)

    @property
    def expires_at(self) -> float:
        """Monotonic; math.inf: no TTL."""
        row, t = self.locate(), self.table
        return t.m_expires_at[row] if t.m_flags[row] & TTL else math.inf

    @property
    def pinned_until(self) -> float:
        """Monotonic; math.inf: pinned until unpinned; 0.0: never pinned."""
        return self.table.pins.get(self.locate(), 0.0)

    @pinned_until.setter
    def pinned_until(self, until: float) -> None:
        row = self.locate()
        if until > 0:
            self.table.pins[row] = until
        else:
            self.table.pins.pop(row, None)

    def is_live(self, now: float) -> bool:
        """Not past its TTL at `now` (monotonic): the one liveness rule every reader applies."""
        row, t = self.locate(), self.table
        return not t.m_flags[row] & TTL or t.m_expires_at[row] > now

    def is_pinned(self, now: float) -> bool:
        return self.table.pins.get(self.locate(), 0.0) > now

    def placement(self) -> tuple[int, int, bytes]:
        """(arena offset, size, checksum), read at once."""
        row, t = self.locate(), self.table
        return (t.m_offset[row] << OFFSET_SHIFT, t.m_size[row],
                bytes(t.m_checksum[row * CHECKSUM_BYTES:(row + 1) * CHECKSUM_BYTES]))

    def read_fields(self) -> tuple[int, int, bytes, dict]:
        """What a get hit sends of the object: (arena offset, size, checksum, descriptor wire)."""
        row, t = self.locate(), self.table
        return (t.m_offset[row] << OFFSET_SHIFT, t.m_size[row], bytes(t.m_checksum[row * CHECKSUM_BYTES:(row + 1) * CHECKSUM_BYTES]),
                _wire_of(t.descriptor_at(row)))

    def get_reply(self, lease_id: int, tier: str = "host", offset: int | None = None) -> GetReply:
        """What a get hit sends: where to read (the host arena; tier "gpu": `offset` into the
        GPU buffer), how to check it, and what it is."""
        at, size, checksum, wire = self.read_fields()
        return GetReply(True, lease=lease_id, offset=at if offset is None else offset, size=size,
                        checksum=checksum, tier=tier, descriptor=wire)

    def to_wire(self, tier: str = "host") -> dict:
        return {
            "object_id": self.object_id.digest,
            "size": self.size,
            "checksum": self.checksum,
            "descriptor": self.descriptor.to_wire(),
            "hints": self.hints.to_wire(),
            "tier": tier,
            "created_at": self.created_at,
            "num_hits": self.num_hits,
        }


@functools.lru_cache(maxsize=4096)
def _wire_of(descriptor: StateDescriptor) -> dict:
    """One wire map per distinct descriptor (never mutated): a get_many reply sends each once."""
    return descriptor.to_wire()
