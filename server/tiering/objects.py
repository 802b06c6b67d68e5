"""What the daemon knows about one committed object."""

from __future__ import annotations

import functools
import itertools
import math
import struct
import time
from dataclasses import dataclass

from kvstore.errors import Conflict
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor, descriptor_differences
from kvstore.replies import GetReply
from kvstore.tiers.allocator import Extent

_SERIALS = itertools.count(1)
CHECKSUM_BYTES = 16  # xxh3-128


# An entry's fields that never change, packed in one bytes object: extent offset and length
# (0: none), size, created_at, serial, checksum. Five Python objects (an Extent and its ints, a
# float, the checksum's bytes) and their slots cost ~220 B per object; the record ~96.
_RECORD = struct.Struct("<QQQdQ16s")
_EXTENT = struct.Struct("<QQ")


class ObjectEntry:
    """A committed, immutable object in the host tier. Mutable fields are bookkeeping only."""

    __slots__ = ("object_id", "namespace", "_record", "descriptor", "hints", "expires_at", "pinned_until",
                 "num_hits", "readers", "deleted", "on_nvme", "descriptor_wire")

    def __init__(self, object_id: ObjectId, namespace: str, extent: Extent | None, size: int, checksum: bytes,
                 descriptor: StateDescriptor, hints: Hints, created_at: float, serial: int):
        if len(checksum) != CHECKSUM_BYTES:
            raise ValueError(f"an entry's checksum is {CHECKSUM_BYTES} bytes, got {len(checksum)}")
        self.object_id = object_id
        self.namespace = namespace
        self._record = _RECORD.pack(0 if extent is None else extent.offset, 0 if extent is None else extent.length,
                                    size, created_at, serial, checksum)
        self.descriptor = descriptor
        self.hints = hints
        self.expires_at = math.inf  # monotonic; from hints.ttl_s
        self.pinned_until = 0.0  # monotonic; math.inf = pinned until unpinned
        self.num_hits = 0
        self.readers = 0  # read leases on this entry
        self.deleted = False  # removed from the index, extent freed when the last reader leaves
        self.on_nvme = False  # a verified copy is on the NVMe tier too
        self.descriptor_wire: dict | None = None  # descriptor.to_wire(), shared by equal descriptors: every get sends it

    @classmethod
    def create(cls, object_id: ObjectId, namespace: str, extent, size: int, checksum: bytes,
               descriptor: StateDescriptor, hints: Hints, now: float, created_at: float | None = None,
               pin: bool = False, on_nvme: bool = False) -> ObjectEntry:
        """The one way to make an entry: it expires hints.ttl_s after its put (`now`, monotonic,
        for a new one; for a copy of an older object, `created_at` on the wall clock: a TTL
        counts from the put on every tier), and is pinned until unpinned when `pin`."""
        wall = time.time()
        entry = cls(object_id, namespace, extent, size, checksum, descriptor, hints,
                    wall if created_at is None else created_at, next(_SERIALS))
        if hints.ttl_s is None:
            entry.expires_at = math.inf
        else:
            age = 0.0 if created_at is None else max(0.0, wall - created_at)
            entry.expires_at = now + hints.ttl_s - age
        entry.pinned_until = math.inf if pin else 0.0
        entry.on_nvme = on_nvme
        return entry

    @property
    def extent(self) -> Extent | None:
        """Where the bytes are in the namespace's arena: equal (not the same object) each time."""
        offset, length = _EXTENT.unpack_from(self._record)
        return Extent(offset, length) if length else None

    @property
    def offset(self) -> int:
        return _EXTENT.unpack_from(self._record)[0]

    @property
    def size(self) -> int:
        return _RECORD.unpack(self._record)[2]

    @property
    def created_at(self) -> float:
        """Wall clock, for listings."""
        return _RECORD.unpack(self._record)[3]

    @property
    def serial(self) -> int:
        """This copy of the object, never reused."""
        return _RECORD.unpack(self._record)[4]

    @property
    def checksum(self) -> bytes:
        return self._record[-CHECKSUM_BYTES:]

    def __repr__(self) -> str:
        return (f"ObjectEntry({self.object_id}, namespace={self.namespace!r}, extent={self.extent}, size={self.size}, "
                f"readers={self.readers}, deleted={self.deleted}, on_nvme={self.on_nvme})")

    def is_live(self, now: float) -> bool:
        """Not past its TTL at `now` (monotonic): the one liveness rule every reader applies."""
        return self.expires_at > now

    def placement(self) -> tuple[int, int, bytes]:
        """(arena offset, size, checksum), read at once."""
        at, _, size, _, _, checksum = _RECORD.unpack(self._record)
        return at, size, checksum

    def read_fields(self) -> tuple[int, int, bytes, dict]:
        """What a get hit sends of the object: (arena offset, size, checksum, descriptor wire)."""
        if self.descriptor_wire is None:
            self.descriptor_wire = _wire_of(self.descriptor)
        at, _, size, _, _, checksum = _RECORD.unpack(self._record)
        return at, size, checksum, self.descriptor_wire

    def get_reply(self, lease_id: int, tier: str = "host", offset: int | None = None) -> GetReply:
        """What a get hit sends: where to read (the host arena; tier "gpu": `offset` into the
        GPU buffer), how to check it, and what it is."""
        at, size, checksum, wire = self.read_fields()
        return GetReply(True, lease=lease_id, offset=at if offset is None else offset, size=size,
                        checksum=checksum, tier=tier, descriptor=wire)

    def is_pinned(self, now: float) -> bool:
        return self.pinned_until > now

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


@dataclass(slots=True)
class PendingPut:
    """An extent reserved for a put that is not committed yet (a write lease)."""

    namespace: str
    object_id: ObjectId
    size: int
    descriptor: StateDescriptor
    hints: Hints
    extent: Extent
    tier: str = "host"  # "remote": the commit sends it to its home nodes


def live_in(ns, oid: ObjectId, now: float) -> ObjectEntry | None:
    """The entry of `oid` in namespace `ns` (None: not open here), unless absent or past its
    TTL at `now`. Reads only: a get drops an expired entry (HostTier.live_entry); peers, the
    admin API and re-homing merely do not see it."""
    entry = ns.objects.get(oid) if ns is not None else None
    return entry if entry is not None and entry.is_live(now) else None


def check_same_object(oid: ObjectId, size: int, descriptor, new_size: int, new_descriptor,
                      checksum: bytes | None = None, new_checksum: bytes | None = None) -> None:
    """A put of an id already stored: the same state (dedup), or Conflict if it differs. With
    both checksums (a commit, whose bytes are known), other bytes conflict too: one id names
    one state, and a read must never see the stored bytes change."""
    if checksum is not None and new_checksum is not None and checksum != new_checksum \
            and size == new_size and descriptor == new_descriptor:
        raise Conflict(
            f"object {oid.hex} is already stored with other bytes of the same size and descriptor "
            "(checksums differ); the stored bytes stand: delete the object first to replace it")
    if size != new_size or descriptor != new_descriptor:
        diff = descriptor_differences(descriptor, new_descriptor)
        raise Conflict(
            f"object {oid.hex} is already stored with "
            + (f"{size} bytes, not {new_size}" if size != new_size else "another descriptor")
            + (f" ({diff}; stored != put)" if diff else "")
            + "; an id names one state: delete it first, or compute the key from the put's descriptor"
        )


@functools.lru_cache(maxsize=4096)
def _wire_of(descriptor: StateDescriptor) -> dict:
    """One wire map per distinct descriptor (never mutated): a get_many reply sends each once."""
    return descriptor.to_wire()
